"""The export_merged op of a model pool (workers/exports.py) in process, on the transformers backend and the tiny
model: merged once per checkpoint and answered from its record afterwards, its check recorded in the checkpoint's
metadata and listing, a tampered merge recorded as failed and never kept, the export gone with its checkpoint,
and the backends that cannot merge refused by name."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from twinkle.checkpoints import MERGED_RECORD, CheckpointRef, CheckpointStore
from twinkle.config.export import ExportConfig
from twinkle.errors import ExportVerificationFailed, InvalidRequest, LimitExceeded
from twinkle.futures import FutureRecord, new_request_id
from twinkle.keys import Keys
from twinkle.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec, chunks_from_tokens
from workers.exports import ExportSettings, MergedExports
from workers.handlers import CheckpointIndex

OWNER = "t0wner"
RUN = "s1:train:0"
TOKENS = [5 + (i * 7) % 300 for i in range(24)]


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> Any:
    import torch

    from twinkle.backends.transformers_backend import TransformersBackend

    torch.set_num_threads(1)
    hf = TransformersBackend(str(tiny_model_dir), torch_dtype="float32", device="cpu")
    hf.create_adapter(RUN, LoraSpec(rank=8, seed=3))  # attention, MLP and the output head, as the SDK's default
    batch = ForwardBackwardInput([Datum(chunks_from_tokens(TOKENS[:-1]),
                                        {"target_tokens": np.asarray(TOKENS[1:], np.int64)})], "cross_entropy")
    for _ in range(2):
        hf.forward_backward(RUN, batch)
        hf.optim_step(RUN, AdamParams(learning_rate=0.05))
    return hf


@pytest.fixture
def pool(backend: Any, redis_keys: tuple[redis.Redis, Keys], tiny_model_dir: Path, tmp_path: Path
         ) -> Iterator[tuple[MergedExports, CheckpointStore, list[int]]]:
    r, keys = redis_keys
    store = CheckpointStore(tmp_path / "checkpoints")
    exports = MergedExports(backend, store, r, keys,
                            ExportSettings("transformers", str(tiny_model_dir), ExportConfig(), "float32"))
    merges: list[int] = []

    def counted(peft: Any) -> Any:
        from twinkle.backends.hf.merge import merge_lora

        merges.append(1)
        return merge_lora(peft)

    exports.merge = counted
    yield exports, store, merges


def save(exports: MergedExports, name: str = "step-2", kind: str = "weights") -> CheckpointRef:
    """A checkpoint of RUN as the pool saves one (files, metadata, listing in Redis)."""
    ref = CheckpointRef(RUN, kind, name)  # type: ignore[arg-type]
    tmp = exports.store.begin(OWNER, ref)
    exports.backend.save_state(RUN, tmp, include_optimizer=False)
    metadata = exports.store.commit(OWNER, ref, tmp, {
        "checkpoint_id": ref.checkpoint_id, "tinker_path": ref.uri(), "run_id": RUN, "base_model": "tiny-qwen",
        "lora": {"rank": 8, "seed": 3}, "time": time.time()}, overwrite=True)
    CheckpointIndex(exports.r, exports.keys).record(ref, metadata, None)
    return ref


def export(exports: MergedExports, ref: CheckpointRef) -> dict[str, Any]:
    rec = FutureRecord(new_request_id(), "export_merged", OWNER, "", "model.tiny.0")
    return exports.export(rec, {"path": ref.uri()})


def listed(exports: MergedExports, ref: CheckpointRef) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(exports.r.hget(exports.keys.checkpoints(ref.run_id), ref.checkpoint_id))
    return entry


def test_a_checkpoint_is_merged_once_and_later_requests_answer_its_recorded_check(
        pool: tuple[MergedExports, CheckpointStore, list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    exports, store, merges = pool
    ref = save(exports)
    first = export(exports, ref)
    assert first["status"] == "verified" and merges == [1]
    check = first["export"]
    assert check["max_abs_diff"] < 1e-3 and check["tolerance"] == 1e-3
    assert check["adapter"]["status"] == check["merged"]["status"] == "verified"
    assert export(exports, ref) == first and merges == [1]  # answered from the record

    assert store.metadata(OWNER, ref)["export"] == check  # the checkpoint's metadata
    assert listed(exports, ref)["export"] == check  # list_checkpoints and the console read this
    directory = store.merged_path(OWNER, ref)
    assert sorted(first["files"]) == sorted(p.name for p in directory.iterdir() if p.name != MERGED_RECORD)
    assert AutoModelForCausalLM.from_pretrained(directory) is not None
    assert exports.backend.resident_adapters() == [RUN]  # the check's temporary adapter is gone


def test_a_peft_adapter_export_is_checked_as_a_user_loads_it_and_the_check_is_listed(
        pool: tuple[MergedExports, CheckpointStore, list[int]]) -> None:
    exports, store, merges = pool
    ref = save(exports, "peft", kind="external_weights")
    check = exports.check_adapter(FutureRecord(new_request_id(), "save_weights_external", OWNER, RUN, "q"), ref)
    assert check is not None and check["status"] == "verified" and check["max_abs_diff"] < 1e-3
    assert check["adapter"]["status"] == "verified" and "merged" not in check and merges == []
    assert listed(exports, ref)["export"] == check == store.metadata(OWNER, ref)["export"]
    assert exports.backend.resident_adapters() == [RUN]
    assert exports.settings is not None
    exports.settings.config = ExportConfig(verify_adapter_exports=False)  # an operator's switch for huge models
    assert exports.check_adapter(FutureRecord(new_request_id(), "x", OWNER, RUN, "q"), ref) is None


def test_a_tampered_merge_is_recorded_as_failed_with_its_difference_and_its_weights_are_not_kept(
        pool: tuple[MergedExports, CheckpointStore, list[int]]) -> None:
    from peft.tuners.lora import LoraLayer

    from twinkle.backends.hf.merge import merge_lora

    exports, store, _ = pool
    ref = save(exports, "tampered")

    def wrong_scale(peft: Any) -> Any:  # merges alpha / rank twice over, a classic merge bug
        for module in peft.modules():
            if isinstance(module, LoraLayer):
                module.scaling = {name: 2 * value for name, value in module.scaling.items()}
        return merge_lora(peft)

    exports.merge = wrong_scale
    with pytest.raises(ExportVerificationFailed, match="not offered for download") as failure:
        export(exports, ref)
    assert failure.value.details["max_abs_diff"] > 1e-3
    record = store.merged_record(OWNER, ref)
    assert record is not None and record["status"] == "failed" and record["files"] == []
    assert [p.name for p in store.merged_path(OWNER, ref).iterdir()] == [MERGED_RECORD]
    shown = listed(exports, ref)["export"]
    assert shown["status"] == "failed" and shown["merged"]["max_abs_diff"] == failure.value.details["max_abs_diff"]
    assert shown["adapter"]["status"] == "verified"  # the PEFT download itself is fine
    exports.merge = None
    with pytest.raises(ExportVerificationFailed):  # the recorded answer, not a second merge
        export(exports, ref)


def test_a_merged_export_goes_when_its_checkpoint_is_overwritten_or_deleted(
        pool: tuple[MergedExports, CheckpointStore, list[int]]) -> None:
    exports, store, merges = pool
    ref = save(exports, "kept")
    export(exports, ref)
    assert store.merged_record(OWNER, ref) is not None
    save(exports, "kept")  # overwritten: the export of the old weights goes
    assert not store.merged_path(OWNER, ref).exists() and "export" not in listed(exports, ref)
    export(exports, ref)
    assert merges == [1, 1] and store.merged_record(OWNER, ref) is not None
    store.delete(OWNER, ref)
    assert not store.merged_path(OWNER, ref).exists()


@pytest.mark.parametrize(("backend_name", "says"), [("megatron", "megatron backend, which cannot merge"),
                                                     ("mock", "mock backend, which holds no Hugging Face weights")])
def test_a_pool_whose_backend_cannot_merge_refuses_by_name(
        pool: tuple[MergedExports, CheckpointStore, list[int]], backend_name: str, says: str) -> None:
    exports, _, merges = pool
    ref = save(exports, f"on-{backend_name}")
    assert exports.settings is not None
    exports.settings.backend = backend_name
    with pytest.raises(InvalidRequest, match=says):
        export(exports, ref)
    assert merges == []


def test_the_check_borrows_a_lora_slot_leaving_the_tenant_paged_out_intact_or_says_it_needs_one(
        redis_keys: tuple[redis.Redis, Keys], tiny_model_dir: Path, tmp_path: Path) -> None:
    from twinkle.backends.paging import PagingBudget
    from twinkle.backends.transformers_backend import TransformersBackend

    r, keys = redis_keys
    for paging, name in ((PagingBudget(), "paged"), (PagingBudget(host_bytes=0, disk_bytes=0), "full")):
        hf = TransformersBackend(str(tiny_model_dir), torch_dtype="float32", device="cpu", max_loras=1, paging=paging)
        hf.create_adapter(RUN, LoraSpec(rank=8, seed=3))
        exports = MergedExports(hf, CheckpointStore(tmp_path / name), r, keys,
                                ExportSettings("transformers", str(tiny_model_dir), ExportConfig(), "float32"))
        ref = save(exports, name)
        batch = ForwardBackwardInput([Datum(chunks_from_tokens(TOKENS[:-1]),
                                            {"target_tokens": np.asarray(TOKENS[1:], np.int64)})], "cross_entropy")
        before = hf.forward(RUN, batch).loss_fn_outputs[0]["logprobs"]
        if name == "paged":
            assert export(exports, ref)["status"] == "verified"
            np.testing.assert_array_equal(hf.forward(RUN, batch).loss_fn_outputs[0]["logprobs"], before)
        else:
            with pytest.raises(LimitExceeded, match="needs a LoRA slot for a moment"):
                export(exports, ref)
            assert hf.has_adapter(RUN) and not exports.store.merged_path(OWNER, ref).exists()
