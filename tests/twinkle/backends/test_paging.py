"""LoRA slots as a cache: adapters beyond max_loras are paged out to host memory, then disk, and come back
bit-identically, on the mock backend (numpy) and the transformers backend (torch + PEFT)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from twinkle.backends.mock import MockBackend
from twinkle.backends.paging import MIB, PagingBudget
from twinkle.errors import InvalidRequest, LimitExceeded, NotFound
from twinkle.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec, chunks_from_tokens

if TYPE_CHECKING:
    from tests.twinkle.backends.conftest import BackendFactory
    from twinkle.backends.transformers_backend import TransformersBackend

VOCAB = 64
ADAM = AdamParams(learning_rate=0.05)
PATTERN = list(range(100, 110)) * 3


def batch(tokens: list[int], copies: int = 2) -> ForwardBackwardInput:
    datum = Datum(chunks_from_tokens(tokens[:-1]), {"target_tokens": np.asarray(tokens[1:], np.int64)})
    return ForwardBackwardInput([datum] * copies)


def step(backend: Any, adapter_id: str, tokens: list[int]) -> None:
    backend.forward_backward(adapter_id, batch(tokens))
    backend.optim_step(adapter_id, ADAM)


def mock_state(backend: MockBackend, adapter_id: str, directory: Path) -> dict[str, np.ndarray]:
    directory.mkdir()
    backend.save_state(adapter_id, directory, include_optimizer=True)
    with np.load(directory / "adapter.npz") as stored:
        return {key: stored[key] for key in stored.files}


def touch_others(backend: Any, count: int, tokens: list[int]) -> None:
    """Create and train `count` other adapters, each pushing the least recently used one out of its slot."""
    for index in range(count):
        adapter_id = f"other-{index}"
        if not backend.has_adapter(adapter_id):
            backend.create_adapter(adapter_id, LoraSpec(rank=4, seed=100 + index))
        step(backend, adapter_id, tokens)


# -- mock backend ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_mock_adapter_paged_out_and_back_trains_exactly_like_one_that_never_left(
        tier: str, tmp_path: Path) -> None:
    budget = PagingBudget(host_bytes=0 if tier == "disk" else 64 * MIB, disk_bytes=64 * MIB,
                          directory=str(tmp_path / "pages"))
    paged = MockBackend(VOCAB, max_loras=2, paging=budget)
    stayed = MockBackend(VOCAB, max_loras=8)
    tokens = [3, 17, 42, 8, 29] * 6
    for backend in (paged, stayed):
        backend.create_adapter("x", LoraSpec(rank=8, seed=7, dropout=0.2))
        step(backend, "x", tokens)
        backend.forward_backward("x", batch(tokens[::-1]))  # a pending gradient travels too
    touch_others(paged, 3, tokens[1:])
    assert not paged.pager.is_resident("x") and paged.has_adapter("x")
    assert paged.pager.stats.page_outs >= 2
    if tier == "disk":
        assert paged.pager.stats.bytes_written_to_disk > 0 and list((tmp_path / "pages").glob("*/*.pkl"))
    for backend in (paged, stayed):
        backend.optim_step("x", ADAM)
        step(backend, "x", tokens)
    assert paged.pager.is_resident("x")
    left, right = mock_state(paged, "x", tmp_path / "paged"), mock_state(stayed, "x", tmp_path / "stayed")
    assert left.keys() == right.keys()
    for key in left:
        assert np.array_equal(left[key], right[key]), key
    assert paged.pager.stats.page_ins >= 1 and paged.pager.stats.bytes_paged_in > 0


def test_sixteen_mock_adapters_round_robin_on_four_slots_never_hit_the_wall() -> None:
    backend = MockBackend(VOCAB, max_loras=4)
    for index in range(16):
        backend.create_adapter(f"a{index}", LoraSpec(rank=4, seed=index))
    for _ in range(2):
        for index in range(16):
            step(backend, f"a{index}", [1, 2, 3, 4, 5, 6])
    assert len(backend.resident_adapters()) == 4
    assert backend.resident_adapters() == ["a12", "a13", "a14", "a15"]  # the most recently used
    stats = backend.paging_stats()
    assert stats["page_ins"] == 2 * 16 and stats["in_host"] == 12  # round robin: every use pages in


def test_when_host_and_disk_are_full_creating_fails_and_the_paged_out_adapter_is_put_back(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB, max_loras=1, paging=PagingBudget(host_bytes=1, disk_bytes=1,
                                                                   directory=str(tmp_path)))
    backend.create_adapter("a", LoraSpec(rank=4, seed=1))
    step(backend, "a", [1, 2, 3, 4])
    with pytest.raises(LimitExceeded, match=r"All 1 LoRA slots .*storage for paged-out adapters is full") as error:
        backend.create_adapter("b", LoraSpec(rank=4))
    assert "ServiceClient.close" in str(error.value)
    assert backend.pager.is_resident("a") and not backend.has_adapter("b")
    step(backend, "a", [1, 2, 3, 4])  # nothing of a was lost


def test_removing_a_paged_out_adapter_deletes_its_page_file(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB, max_loras=1, paging=PagingBudget(host_bytes=0, directory=str(tmp_path)))
    backend.create_adapter("a", LoraSpec(rank=4, seed=1))
    backend.create_adapter("b", LoraSpec(rank=4, seed=2))
    assert len(list(tmp_path.glob("*/*.pkl"))) == 1
    backend.remove_adapter("a")
    assert not list(tmp_path.glob("*/*.pkl")) and not backend.has_adapter("a")
    with pytest.raises(NotFound):
        backend.forward("a", batch([1, 2, 3]))
    assert backend.paging_stats()["on_disk"] == 0


def test_page_files_of_a_dead_process_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "twinkle-paged-999999999-abc"
    stale.mkdir()
    (stale / "x.pkl").write_bytes(b"old")
    backend = MockBackend(VOCAB, max_loras=1, paging=PagingBudget(host_bytes=0, directory=str(tmp_path)))
    backend.create_adapter("a", LoraSpec(rank=4, seed=1))
    backend.create_adapter("b", LoraSpec(rank=4, seed=2))
    assert not stale.exists()


def test_each_data_parallel_rank_pages_its_own_replica_and_the_ranks_stay_identical(tmp_path: Path) -> None:
    from tests.twinkle.backends.test_data_parallel import ThreadRanks
    from twinkle.backends.data_parallel import DataParallelBackend

    ranks = ThreadRanks(2, lambda: MockBackend(VOCAB, max_loras=1))
    parallel = DataParallelBackend(ranks, dp_size=2, info=ranks.replicas[0].backend.info, spmd=False)
    for adapter_id in ("a", "b", "c"):  # three adapters on one slot per rank: every switch pages
        parallel.create_adapter(adapter_id, LoraSpec(rank=4, seed=1))
    for _ in range(2):
        for adapter_id in ("a", "b", "c"):
            parallel.forward_backward(adapter_id, batch([3, 17, 42, 8, 29] * 3, copies=4))
            parallel.optim_step(adapter_id, ADAM)
    for rank, replica in enumerate(ranks.replicas):
        assert replica.backend.paging_stats()["page_ins"] >= 5, rank
        assert replica.backend.resident_adapters() == ["c"]
    left = mock_state(ranks.replicas[0].backend, "a", tmp_path / "rank0")
    right = mock_state(ranks.replicas[1].backend, "a", tmp_path / "rank1")
    for key in left:
        assert np.array_equal(left[key], right[key]), key  # paged in and out, the ranks never drift apart


# -- transformers backend ---------------------------------------------------------------------------------


def torch_state(backend: TransformersBackend, adapter_id: str) -> dict[str, Any]:
    tenant = backend.tenant(adapter_id)
    return {
        "weights": [param.detach().clone() for param in tenant.params],
        "grads": [None if param.grad is None else param.grad.clone() for param in tenant.params],
        "optimizer": tenant.optimizer.state_dict(),
        "rng": tenant.rng.cpu.clone(),
        "steps": tenant.steps,
    }


def assert_identical(left: dict[str, Any], right: dict[str, Any]) -> None:
    import torch

    for a, b in zip(left["weights"], right["weights"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(left["grads"], right["grads"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(left["rng"], right["rng"]) and left["steps"] == right["steps"]
    assert left["optimizer"]["param_groups"] == right["optimizer"]["param_groups"]
    for slot_a, slot_b in zip(left["optimizer"]["state"].values(), right["optimizer"]["state"].values(), strict=True):
        assert slot_a.keys() == slot_b.keys()
        for key in slot_a:
            assert torch.equal(slot_a[key], slot_b[key]), key


def test_a_transformers_adapter_paged_to_host_then_disk_and_back_trains_bit_identically(
        make_backend: BackendFactory, tmp_path: Path) -> None:
    paged = make_backend(max_loras=2, paging=PagingBudget(directory=str(tmp_path)))
    stayed = make_backend(max_loras=2)
    spec = LoraSpec(rank=4, seed=11, dropout=0.1)  # dropout: the adapter's random stream must travel too
    for backend in (paged, stayed):
        backend.create_adapter("x", spec)
        for _ in range(2):
            step(backend, "x", PATTERN)
        backend.forward_backward("x", batch(PATTERN[1:]))  # accumulated, not yet applied
    touch_others(paged, 2, PATTERN[2:])
    assert paged.pager.paged_ids() == ["x"] and paged.paging_stats()["in_host"] == 1
    # host memory for x alone: the next adapter paged out pushes x, the oldest there, to disk
    paged.pager.budget = PagingBudget(host_bytes=paged.pager.stats.bytes_paged_out, directory=str(tmp_path))
    touch_others(paged, 4, PATTERN[3:])
    stats = paged.paging_stats()
    assert stats["on_disk"] >= 1 and stats["bytes_written_to_disk"] > 0
    assert not paged.pager.is_resident("x")
    for backend in (paged, stayed):
        backend.optim_step("x", ADAM)
        step(backend, "x", PATTERN)
    assert paged.paging_stats()["page_ins_from_disk"] >= 1
    assert_identical(torch_state(paged, "x"), torch_state(stayed, "x"))
    # and the PEFT adapter it came back on holds the same weights the checkpoint writer sees
    for backend, name in ((paged, "paged"), (stayed, "stayed")):
        (tmp_path / name).mkdir()
        backend.save_weights_for_sampler("x", tmp_path / name)
    assert (tmp_path / "paged" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "stayed" / "adapter_model.safetensors").read_bytes()


def test_paging_out_frees_the_peft_adapter_and_a_removed_paged_adapter_is_gone(
        make_backend: BackendFactory) -> None:
    backend = make_backend(max_loras=1)
    backend.create_adapter("a", LoraSpec(rank=2, seed=1))
    backend.create_adapter("b", LoraSpec(rank=2, seed=2))
    assert len(backend.shared.adapters) == 1 and backend.has_adapter("a")
    with pytest.raises(InvalidRequest, match="already exists"):  # paged out, it still exists
        backend.create_adapter("a", LoraSpec(rank=2, seed=1))
    backend.remove_adapter("a")
    assert not backend.has_adapter("a") and backend.paging_stats()["in_host"] == 0
    with pytest.raises(NotFound):
        backend.forward("a", batch(PATTERN))


def test_a_fused_pass_is_split_so_each_part_fits_in_the_slots() -> None:
    from twinkle.backends.hf.paging import slot_sized

    calls = [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("d", 5), ("c", 6)]
    assert slot_sized(calls, 2) == [[("a", 1), ("b", 2), ("a", 3)], [("c", 4), ("d", 5), ("c", 6)]]
    assert slot_sized(calls, 8) == [calls]
    assert slot_sized([], 2) == []


def test_a_fused_pass_over_more_adapters_than_slots_pages_them_in_part_by_part(make_backend: BackendFactory) -> None:
    fused = make_backend(max_loras=2)
    alone = make_backend(max_loras=4)
    for backend in (fused, alone):
        for index, adapter_id in enumerate(("a", "b", "c")):
            backend.create_adapter(adapter_id, LoraSpec(rank=4, seed=index))
    calls = [(adapter_id, batch(PATTERN[index:]), False) for index, adapter_id in enumerate(("a", "b", "c"))]
    results = fused.run_fused(calls)
    assert fused.paging_stats()["page_ins"] >= 1
    for (adapter_id, data, _), got in zip(calls, results, strict=True):
        assert not isinstance(got, Exception), got
        want = alone.forward(adapter_id, data)
        np.testing.assert_allclose(got.loss_fn_outputs[0]["logprobs"], want.loss_fn_outputs[0]["logprobs"],
                                   rtol=1e-5, atol=1e-6)
