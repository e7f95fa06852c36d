"""Data-parallel splitting and merging, and a two-rank group of mock replicas driven without Ray.

The ranks here are threads and their all-reduce a barrier, so the routing of DataParallelBackend, the rank
side (RankReplica) and MockBackend.sync_gradients are checked in milliseconds; tests/workers/test_device_group.py
runs the same on real Ray actors with torch.distributed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinkle.backends.data_parallel import (
    DataParallelBackend,
    merge_metrics,
    merge_outputs,
    replica_seed,
    shard_bounds,
    split_batch,
)
from twinkle.backends.mock import MockBackend
from twinkle.errors import InvalidRequest
from twinkle.types import AdamParams, Datum, ForwardBackwardInput, ForwardBackwardOutput, LoraSpec, chunks_from_tokens
from workers.rank_replica import RankReplica

VOCAB = 64


def batch(rows: int, seed: int = 0, loss_fn: str = "cross_entropy") -> ForwardBackwardInput:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(rows):
        tokens = rng.integers(0, VOCAB, 9)
        data.append(Datum(chunks_from_tokens(tokens[:-1]), {"target_tokens": tokens[1:]}))
    return ForwardBackwardInput(data, loss_fn=loss_fn)


def test_shards_are_contiguous_and_as_even_as_whole_units_allow() -> None:
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert shard_bounds(6, 2, unit=2) == [(0, 4), (4, 6)]
    with pytest.raises(InvalidRequest):
        shard_bounds(5, 2, unit=2)


def test_dpo_pairs_are_never_split_across_ranks() -> None:
    shards = split_batch(batch(6, loss_fn="dpo"), 2)
    assert [len(s.data) if s else 0 for s in shards] == [4, 2]
    assert [len(s.data) if s else 0 for s in split_batch(batch(3), 4)] == [1, 1, 1, 0]


def test_metrics_merge_by_their_reduction_suffix() -> None:
    merged = merge_metrics([{"loss:sum": 1.0, "acc:mean": 1.0, "len:max": 3.0, "len:min": 2.0},
                            {"loss:sum": 2.5, "acc:mean": 0.0, "len:max": 7.0, "len:min": 1.0}], [3, 1])
    assert merged == {"loss:sum": 3.5, "acc:mean": 0.75, "len:max": 7.0, "len:min": 1.0}


def test_outputs_merge_in_shard_order_and_skip_empty_shards() -> None:
    parts = [ForwardBackwardOutput([{"x": np.array([i])} for i in (0, 1)], {"loss:sum": 1.0}), None,
             ForwardBackwardOutput([{"x": np.array([2])}], {"loss:sum": 2.0})]
    merged = merge_outputs(parts)
    assert [int(row["x"][0]) for row in merged.loss_fn_outputs] == [0, 1, 2]
    assert merged.metrics == {"loss:sum": 3.0}


def test_replicas_share_a_seed_derived_from_the_adapter_id_unless_one_is_given() -> None:
    assert replica_seed("a", LoraSpec()).seed == replica_seed("a", LoraSpec()).seed
    assert replica_seed("a", LoraSpec()).seed != replica_seed("b", LoraSpec()).seed
    assert replica_seed("a", LoraSpec(seed=5)).seed == 5


class BarrierReducer:
    """GradientReducer for ranks that are threads of one process."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self.rank = rank
        self.shared = shared

    def _exchange(self, value: Any) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = value
        barrier.wait()
        values = list(slots)
        barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return values

    def sum_(self, buffers: Sequence[Any]) -> None:
        everyone = self._exchange([np.array(b, copy=True) for b in buffers])
        for index, buffer in enumerate(buffers):
            buffer[...] = sum(theirs[index] for theirs in everyone)


class ThreadRanks:
    """RankGroup whose ranks are RankReplica objects called from one thread each."""

    def __init__(self, size: int, make_backend: Any) -> None:
        shared = {"slots": [None] * size, "barrier": threading.Barrier(size)}
        self.replicas = []
        for rank in range(size):
            replica = RankReplica(args=None, rank=rank, world_size=size)
            replica.backend, replica.reducer = make_backend(), BarrierReducer(rank, shared)
            self.replicas.append(replica)
        self.pool = ThreadPoolExecutor(size)

    @property
    def size(self) -> int:
        return len(self.replicas)

    def call_all(self, method: str, args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        futures = [self.pool.submit(getattr(r, method), *args) for r, args in zip(self.replicas, args_per_rank,
                                                                                   strict=True)]
        return [f.result(timeout=30) for f in futures]

    def call(self, rank: int, method: str, *args: Any) -> Any:
        return getattr(self.replicas[rank], method)(*args)


def test_two_mock_ranks_train_like_one_replica_and_stay_identical(tmp_path: Path) -> None:
    ranks = ThreadRanks(2, lambda: MockBackend(VOCAB))
    parallel = DataParallelBackend(ranks, dp_size=2, info=ranks.replicas[0].backend.info, spmd=False)
    single = MockBackend(VOCAB)
    spec = LoraSpec(rank=4, seed=3)
    parallel.create_adapter("a", spec)
    single.create_adapter("a", spec)
    assert parallel.has_adapter("a")
    for step in range(3):
        data = batch(5, seed=step)  # different batches: rows land on different ranks each step
        ours, theirs = parallel.forward_backward("a", data), single.forward_backward("a", data)
        assert ours.metrics["loss:sum"] == pytest.approx(theirs.metrics["loss:sum"], rel=1e-6)
        for mine, reference in zip(ours.loss_fn_outputs, theirs.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(mine["logprobs"], reference["logprobs"], rtol=1e-6)
        step_ours, step_theirs = parallel.optim_step("a", AdamParams(0.05)), single.optim_step("a", AdamParams(0.05))
        assert step_ours["grad_norm:mean"] == pytest.approx(step_theirs["grad_norm:mean"], rel=1e-5)
    saved = {}
    for name, backend in (("rank0", ranks.replicas[0].backend), ("rank1", ranks.replicas[1].backend),
                          ("single", single)):
        (tmp_path / name).mkdir()
        backend.save_state("a", tmp_path / name, include_optimizer=True)
        saved[name] = dict(np.load(tmp_path / name / "adapter.npz"))
    for key, value in saved["rank0"].items():
        np.testing.assert_array_equal(value, saved["rank1"][key], err_msg=key)  # ranks never drift apart
        if value.dtype.kind == "f":
            np.testing.assert_allclose(value, saved["single"][key], rtol=1e-4, atol=1e-7, err_msg=key)
    parallel.remove_adapter("a")
    assert not parallel.has_adapter("a") and not ranks.replicas[1].backend.has_adapter("a")


def test_a_rank_with_an_empty_shard_still_joins_the_gradient_sum() -> None:
    ranks = ThreadRanks(2, lambda: MockBackend(VOCAB))
    parallel = DataParallelBackend(ranks, dp_size=2, info=ranks.replicas[0].backend.info, spmd=False)
    single = MockBackend(VOCAB)
    for backend in (parallel, single):
        backend.create_adapter("a", LoraSpec(rank=4, seed=1))
        backend.forward_backward("a", batch(1))  # one datum: rank 1 computes nothing
    assert parallel.optim_step("a", AdamParams(0.1))["grad_norm:mean"] == pytest.approx(
        single.optim_step("a", AdamParams(0.1))["grad_norm:mean"], rel=1e-5)
    assert parallel.optim_step("a", AdamParams(0.1))["grad_norm:mean"] == 0.0  # nothing accumulated anywhere
