"""A pool's `device_mesh` mapped to Megatron's parallel state.

Every rank of the pool's device group runs one backend process; torch.distributed is expected to be set up
by whoever started them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun and Ray's device groups
set them). A lone process with none of these is a world of one. `ParallelSizes` needs no megatron-core.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinkle.backends.collectives import rendezvous_store
from twinkle.errors import InvalidRequest


@dataclass(frozen=True)
class ParallelSizes:
    """How many ways each dimension is split; their product is the number of ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1

    @classmethod
    def from_mesh(cls, mesh: Any | None) -> ParallelSizes:
        """From a config DeviceMesh (or anything with dp_size/tp_size/... attributes); None: one rank."""
        if mesh is None:
            return cls()
        sizes = {name: int(getattr(mesh, f"{name}_size", 1) or 1) for name in ("tp", "pp", "dp", "cp", "ep")}
        return cls(**sizes)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def problems(self) -> list[str]:
        """What this backend cannot run yet; each entry says why."""
        problems = []
        if self.pp > 1:
            problems.append(
                f"pp_size={self.pp}: pipeline parallelism needs Megatron's pipeline schedule, "
                "which this backend does not drive yet"
            )
        if self.cp > 1:
            problems.append(f"cp_size={self.cp}: context parallelism is not wired up yet")
        if self.ep > 1:
            problems.append(
                f"ep_size={self.ep}: expert parallelism applies to mixture-of-experts models only"
            )
        return problems


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the mesh and the groups its collectives use."""

    sizes: ParallelSizes
    tp_rank: int
    tp_group: Any
    dp_group: Any

    @property
    def is_first_rank(self) -> bool:
        """The rank that writes checkpoints."""
        return not dist.is_initialized() or dist.get_rank() == 0


def initialize(sizes: ParallelSizes, device: torch.device) -> ParallelState:
    """Join (or, alone, create) the process group and set up Megatron's model-parallel groups."""
    from megatron.core import parallel_state  # deferred: ParallelSizes is read where megatron-core is absent

    problems = sizes.problems()
    if problems:
        raise InvalidRequest(
            "backend: megatron cannot use this device_mesh: " + "; ".join(problems) + ".",
            hint="Use dp_size and tp_size only for now.",
        )
    if not dist.is_initialized():
        _init_process_group(device)
    world = dist.get_world_size()
    if world != sizes.world_size:
        raise InvalidRequest(
            f"device_mesh covers {sizes.world_size} ranks (dp x tp x pp x cp) "
            f"but {world} processes were started.",
            hint="Make nproc_per_node x nodes equal to dp_size x tp_size x pp_size x cp_size.",
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            context_parallel_size=sizes.cp,
            expert_model_parallel_size=sizes.ep,
        )
    elif parallel_state.get_tensor_model_parallel_world_size() != sizes.tp:
        raise InvalidRequest(
            "This process already runs Megatron with another tensor-parallel size "
            f"({parallel_state.get_tensor_model_parallel_world_size()}, not {sizes.tp}).",
            hint="Give each megatron pool its own worker processes.",
        )
    return ParallelState(
        sizes=sizes,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )


def _init_process_group(device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        return
    # A single process: a private rendezvous on a free local port, so two pools on one host never collide.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = rendezvous_store("127.0.0.1", port, rank=0, world_size=1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
