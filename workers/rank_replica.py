"""One rank of a model pool's device group: what runs inside each Ray rank actor.

The rank joins the group's torch.distributed process group first (so SPMD backends find it), then builds
its own backend replica and checkpoint sampler exactly as a single-rank pool would. The pool's worker
process drives the ranks through `twinkle.backends.data_parallel.DataParallelBackend`.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from twinkle.backends.base import FusedEligibility, GradientSync
from twinkle.types import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    ModelInfo,
    SampleOutput,
    SampleRequest,
)

log = logging.getLogger("twinkle.rank")


class RankReplica:
    def __init__(self, args: Any, rank: int, world_size: int) -> None:
        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.backend: Any = None
        self.sampler: Any = None
        self.reducer: Any = None

    def pid(self) -> int:
        return os.getpid()

    def rendezvous(self) -> tuple[str, int]:
        """Where the other ranks meet this one (rank 0) to form the process group: its node's address and
        a free port on it."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            return address, int(s.getsockname()[1])

    def start(self, master_addr: str, master_port: int) -> tuple[ModelInfo, bool]:
        """Join the process group, load the backend; returns its ModelInfo and whether it is SPMD (it
        synchronises gradients itself)."""
        import torch

        from twinkle.backends.collectives import TorchGradientReducer, join_process_group
        from workers.factory import build_backend_and_sampler

        device_type = self.args.device_group.device_type
        collective = join_process_group(master_addr=master_addr, master_port=master_port, rank=self.rank,
                                        world_size=self.world_size, device_type=device_type)
        self.backend, self.sampler = build_backend_and_sampler(self.args)
        device = torch.device("cuda", 0) if collective == "nccl" else torch.device("cpu")
        self.reducer = TorchGradientReducer(device)
        log.info("rank %d/%d ready (%s, pid %d)", self.rank, self.world_size, collective, os.getpid())
        return self.backend.info, not isinstance(self.backend, GradientSync)

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        self.backend.create_adapter(adapter_id, spec)

    def remove_adapter(self, adapter_id: str) -> None:
        self.backend.remove_adapter(adapter_id)

    def run_shard(self, adapter_id: str, batch: ForwardBackwardInput | None,
                  backward: bool) -> ForwardBackwardOutput | None:
        if batch is None:
            return None  # fewer datums than ranks: this one contributes no gradient
        if backward:
            return self.backend.forward_backward(adapter_id, batch)
        return self.backend.forward(adapter_id, batch)

    def fused_solo_reason(self, adapter_id: str, batch: ForwardBackwardInput) -> str | None:
        if not isinstance(self.backend, FusedEligibility):
            return "this backend runs one call at a time"
        return self.backend.fused_solo_reason(adapter_id, batch)

    def run_fused_shards(self, calls: list[tuple[str, ForwardBackwardInput | None, bool]]) -> list[Any]:
        """This rank's shards of several calls as one fused pass (None where a call has no datum here)."""
        present = [index for index, (_, batch, _) in enumerate(calls) if batch is not None]
        results: list[Any] = [None] * len(calls)
        if present:
            outcomes = self.backend.run_fused([calls[index] for index in present])
            for index, outcome in zip(present, outcomes, strict=True):
                results[index] = outcome
        return results

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        if isinstance(self.backend, GradientSync):
            self.backend.sync_gradients(adapter_id, self.reducer)
        return self.backend.optim_step(adapter_id, params)

    def save_state(self, adapter_id: str, directory: str, include_optimizer: bool) -> None:
        self.backend.save_state(adapter_id, Path(directory), include_optimizer=include_optimizer)

    def load_state(self, adapter_id: str, directory: str, include_optimizer: bool) -> None:
        self.backend.load_state(adapter_id, Path(directory), include_optimizer=include_optimizer)

    def save_weights_for_sampler(self, adapter_id: str, directory: str) -> None:
        self.backend.save_weights_for_sampler(adapter_id, Path(directory))

    def sample(self, adapter_id: str | None, requests: list[SampleRequest]) -> list[SampleOutput]:
        return self.backend.sample(adapter_id, requests)

    def sample_checkpoint(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        return self.sampler.sample(requests)
