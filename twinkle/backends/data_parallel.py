"""Data-parallel training over the ranks of a device group, seen by the pool as one ModelBackend.

Every rank holds a whole backend replica (TransformersBackend or MockBackend) with the same adapters,
created from the same seed. `forward_backward` splits the batch into one contiguous shard per rank (DPO
pairs are never split) and each rank accumulates the gradients of its shard's summed loss. `optim_step`
first sums the accumulated gradients over the ranks (an all-reduce inside the ranks: gloo on CPU, NCCL on
GPU), so every rank applies the same update and optimizer states stay identical, which is exactly the
single-rank result on the whole batch up to floating-point summation order.

Checkpoints and sampling use rank 0 (its files must be visible where the pool reads them: the same
machine, or a shared checkpoint directory); `load_state` goes to every rank.

Backends without `sync_gradients` are SPMD backends (megatron): they join the ranks' process group and
synchronise themselves, so every call goes to every rank and rank 0 answers. Ranks sharing a data shard
(tensor parallelism) get the same shard.

The ranks are reached through `RankGroup` (Ray actors in `workers.device_group`), so this module needs
neither Ray nor torch.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from twinkle.errors import InvalidRequest
from twinkle.types import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    ModelInfo,
    SampleOutput,
    SampleRequest,
)

log = logging.getLogger("twinkle.data_parallel")


class GradientReducer(Protocol):
    """The all-reduce over the data-parallel ranks that a backend's `sync_gradients` uses (once per step:
    each collective costs a round between the ranks, so flags travel in the same call as the gradients)."""

    def sum_(self, buffers: Sequence[Any]) -> None:
        """Replace each buffer (torch tensor or float32 numpy array) by its sum over the ranks, in place."""


class RankGroup(Protocol):
    """The ranks of a device group, each running a `workers.rank_replica.RankReplica`."""

    @property
    def size(self) -> int: ...

    def call_all(self, method: str, args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run `method` on every rank at once (rank i gets args_per_rank[i]); results in rank order."""

    def call(self, rank: int, method: str, *args: Any) -> Any:
        """Run `method` on one rank and return its result."""


def shard_bounds(items: int, shards: int, unit: int = 1) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges splitting `items` over `shards` as evenly as possible, in whole
    multiples of `unit` (leading shards take the remainder; trailing ones may be empty)."""
    units, leftover = divmod(items, unit)
    if leftover:
        raise InvalidRequest(f"{items} datums do not divide into groups of {unit}.")
    base, extra = divmod(units, shards)
    bounds, start = [], 0
    for index in range(shards):
        end = start + (base + (1 if index < extra else 0)) * unit
        bounds.append((start, end))
        start = end
    return bounds


def split_batch(batch: ForwardBackwardInput, shards: int) -> list[ForwardBackwardInput | None]:
    """One sub-batch per shard, None for a shard with no datums; DPO keeps [chosen, rejected] together."""
    unit = 2 if batch.loss_fn == "dpo" and len(batch.data) % 2 == 0 else 1
    return [replace(batch, data=batch.data[start:end]) if end > start else None
            for start, end in shard_bounds(len(batch.data), shards, unit)]


def merge_outputs(parts: Sequence[ForwardBackwardOutput | None]) -> ForwardBackwardOutput:
    """The output of the whole batch from the shards' outputs, in shard order."""
    present = [part for part in parts if part is not None]
    if not present:
        raise InvalidRequest("The batch is empty.", hint="Send at least one datum.")
    outputs = [row for part in present for row in part.loss_fn_outputs]
    weights = [len(part.loss_fn_outputs) for part in present]
    return ForwardBackwardOutput(outputs, merge_metrics([part.metrics for part in present], weights),
                                 present[0].loss_fn_output_type)


def merge_metrics(metrics: Sequence[dict[str, float]], weights: Sequence[int]) -> dict[str, float]:
    """Combine per-shard metrics by their `name:reduction` suffix: sums add, max/min keep the extreme,
    everything else (means) is averaged weighted by each shard's datum count."""
    merged: dict[str, float] = {}
    for name in dict.fromkeys(key for m in metrics for key in m):
        pairs = [(m[name], w) for m, w in zip(metrics, weights, strict=True) if name in m]
        values = [float(v) for v, _ in pairs]
        reduction = name.rsplit(":", 1)[-1] if ":" in name else "mean"
        if reduction == "sum":
            merged[name] = float(sum(values))
        elif reduction == "max":
            merged[name] = max(values)
        elif reduction == "min":
            merged[name] = min(values)
        else:
            total = sum(w for _, w in pairs)
            merged[name] = float(sum(v * w for v, w in pairs) / total) if total else values[0]
    return merged


def replica_seed(adapter_id: str, spec: LoraSpec) -> LoraSpec:
    """The spec with a seed every rank shares: replicas must start from identical weights."""
    if spec.seed is not None:
        return spec
    seed = int.from_bytes(hashlib.sha256(adapter_id.encode()).digest()[:8], "little") >> 1
    return replace(spec, seed=seed)


class DataParallelBackend:
    """Implements `twinkle.backends.base.ModelBackend` over a RankGroup; see the module docstring."""

    def __init__(self, ranks: RankGroup, *, dp_size: int, info: ModelInfo, spmd: bool) -> None:
        if dp_size < 1 or ranks.size % dp_size:
            raise ValueError(f"dp_size {dp_size} does not divide the {ranks.size} ranks of the group")
        self.ranks = ranks
        self.dp_size = dp_size
        self.info = info
        self.spmd = spmd
        self._ranks_per_shard = ranks.size // dp_size
        self._adapters: set[str] = set()  # created on every rank; saves a round trip per op

    # Adapters

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        self._everywhere("create_adapter", adapter_id, replica_seed(adapter_id, spec))
        self._adapters.add(adapter_id)

    def remove_adapter(self, adapter_id: str) -> None:
        self._adapters.discard(adapter_id)
        self._everywhere("remove_adapter", adapter_id)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    # Compute

    def forward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self._sharded(adapter_id, batch, backward=False)

    def forward_backward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self._sharded(adapter_id, batch, backward=True)

    def _sharded(self, adapter_id: str, batch: ForwardBackwardInput, *,
                 backward: bool) -> ForwardBackwardOutput:
        shards = split_batch(batch, self.dp_size)
        per_rank = [(adapter_id, shards[rank // self._ranks_per_shard], backward)
                    for rank in range(self.ranks.size)]
        results = self.ranks.call_all("run_shard", per_rank)
        # one answer per shard: the first rank of each (its tensor-parallel peers computed the same)
        return merge_outputs(results[:: self._ranks_per_shard])

    def fused_solo_reason(self, adapter_id: str, batch: ForwardBackwardInput) -> str | None:
        """Whether the call can share a fused pass (`workers.clock`): rank 0's replica answers for all."""
        if self.spmd:
            return "SPMD backends run one call at a time"
        reason: str | None = self.ranks.call(0, "fused_solo_reason", adapter_id, batch)
        return reason

    def run_fused(self, calls: Sequence[tuple[str, ForwardBackwardInput, bool]]
                  ) -> list[ForwardBackwardOutput | Exception]:
        """Several adapters' calls as one fused pass per rank: every call is sharded as it would be alone, and
        each rank runs its shards of all calls together; each call's shards merge back as alone."""
        shards = [split_batch(batch, self.dp_size) for _, batch, _ in calls]
        per_rank = [([(adapter_id, shards[index][rank // self._ranks_per_shard], backward)
                      for index, (adapter_id, _, backward) in enumerate(calls)],)
                    for rank in range(self.ranks.size)]
        results = self.ranks.call_all("run_fused_shards", per_rank)[:: self._ranks_per_shard]
        outcomes: list[ForwardBackwardOutput | Exception] = []
        for index in range(len(calls)):
            parts = [rank_results[index] for rank_results in results]
            error = next((part for part in parts if isinstance(part, Exception)), None)
            outcomes.append(error if error is not None else merge_outputs(parts))
        return outcomes

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        results: list[dict[str, float]] = self._everywhere("optim_step", adapter_id, params)
        return results[0]

    # Checkpoints: one replica writes (they are identical), every replica reads

    def save_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        self._writer("save_state", adapter_id, str(directory), include_optimizer)

    def load_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        self._everywhere("load_state", adapter_id, str(directory), include_optimizer)

    def save_weights_for_sampler(self, adapter_id: str, directory: Path) -> None:
        self._writer("save_weights_for_sampler", adapter_id, str(directory))

    def sample(self, adapter_id: str | None, requests: list[SampleRequest]) -> list[SampleOutput]:
        result: list[SampleOutput] = self._writer("sample", adapter_id, requests)
        return result

    # Routing

    def _everywhere(self, method: str, *args: Any) -> Any:
        return self.ranks.call_all(method, [args] * self.ranks.size)

    def _writer(self, method: str, *args: Any) -> Any:
        """Rank 0 for replicas; every rank for SPMD backends, whose collectives need all of them."""
        if self.spmd:
            return self._everywhere(method, *args)[0]
        return self.ranks.call(0, method, *args)


class RankZeroSampler:
    """Implements `twinkle.backends.base.SamplerBackend` with the pool sampler of rank 0, for sampler
    checkpoints of a data-parallel model pool."""

    def __init__(self, ranks: RankGroup, info: ModelInfo) -> None:
        self.ranks = ranks
        self.info = info

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        result: list[SampleOutput] = self.ranks.call(0, "sample_checkpoint", requests)
        return result
