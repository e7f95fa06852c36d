"""The backend-independent side of merged exports (twinkle.merged_export) and where they live on disk
(twinkle.checkpoints): the fixed probe batch, the comparison, which tolerance applies, the refusal that names the
backend, and an export that goes with its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from twinkle import merged_export
from twinkle.checkpoints import MERGED_RECORD, CheckpointRef, CheckpointStore, index_entry
from twinkle.errors import InvalidRequest

OWNER = "talice"
REF = CheckpointRef("run", "weights", "step1")


def test_the_probe_batch_is_fixed_inside_the_vocabulary_and_fits_the_context() -> None:
    rows = merged_export.probe_rows(512)
    assert rows == merged_export.probe_rows(512) and len(rows) == merged_export.PROBE_ROWS
    assert all(len(row) == merged_export.PROBE_TOKENS and min(row) >= 0 and max(row) < 512 for row in rows)
    assert {len(row) for row in merged_export.probe_rows(512, max_length=16)} == {16}


def test_the_difference_is_the_largest_over_all_rows_and_a_mismatch_or_nan_is_infinite() -> None:
    ours = [np.array([-1.0, -2.0]), np.array([-3.0])]
    assert merged_export.max_abs_diff(ours, [np.array([-1.0, -2.5]), np.array([-3.1])]) == pytest.approx(0.5)
    assert merged_export.max_abs_diff(ours, [np.array([-1.0]), np.array([-3.0])]) == float("inf")
    assert merged_export.max_abs_diff(ours, [np.array([-1.0, np.nan]), np.array([-3.0])]) == float("inf")
    assert merged_export.check(2e-4, 1e-3)["status"] == "verified"
    assert merged_export.check(float("inf"), 1e-3)["status"] == "failed"


def test_the_strict_tolerance_applies_only_when_pool_and_export_are_float32() -> None:
    config = SimpleNamespace(tolerance=1e-3, tolerance_16bit=0.1)
    assert merged_export.tolerance_for(config, pool_dtype="float32", export_dtype="float32") == 1e-3
    assert merged_export.tolerance_for(config, pool_dtype="bfloat16", export_dtype="float32") == 0.1
    assert merged_export.tolerance_for(config, pool_dtype="float32", export_dtype="bfloat16") == 0.1


def test_a_backend_that_cannot_merge_is_refused_by_name_with_what_to_do_instead() -> None:
    assert merged_export.refusal("transformers", "Qwen/Qwen3-8B") is None
    megatron = merged_export.refusal("megatron", "Qwen/Qwen3-8B")
    assert isinstance(megatron, InvalidRequest)
    assert "megatron backend, which cannot merge" in str(megatron) and "Qwen/Qwen3-8B" in str(megatron)
    assert "merge_and_unload" in str(megatron)
    assert "mock backend" in str(merged_export.refusal("mock", "tiny"))


def record(status: str = "verified") -> dict[str, object]:
    merged = merged_export.check(0.5 if status == "failed" else 1e-6, 1e-3)
    return merged_export.record(REF.uri(), 1.5, tolerance=1e-3, adapter=merged_export.check(1e-7, 1e-3),
                                merged=merged, dtype="float32", pool_dtype="float32", files=["config.json"],
                                size_bytes=10, shards=1, seconds=0.2)


def test_a_failed_export_offers_no_files_and_its_message_names_the_difference() -> None:
    failed = record("failed")
    assert failed["status"] == "failed" and failed["files"] == [] and failed["size_bytes"] == 0
    message = merged_export.failure_message(failed)  # type: ignore[arg-type]
    assert "0.5" in message and "tolerance 0.001" in message and "not offered for download" in message
    summary = merged_export.summary(record())  # type: ignore[arg-type]
    assert summary["max_abs_diff"] == 1e-6 and summary["merged"]["size_bytes"] == 10
    assert merged_export.is_current(record(), 1.5) and not merged_export.is_current(record(), 2.0)  # type: ignore[arg-type]


def saved(store: CheckpointStore, *, stamp: float = 1.5, overwrite: bool = False) -> None:
    tmp = store.begin(OWNER, REF)
    (tmp / "adapter_model.safetensors").write_bytes(b"weights")
    store.commit(OWNER, REF, tmp, {"base_model": "tiny", "time": stamp}, overwrite=overwrite)


def merged(store: CheckpointStore) -> None:
    tmp = store.begin_merged(OWNER, REF)
    (tmp / "config.json").write_text("{}")
    store.commit_merged(OWNER, REF, tmp, {"status": "verified"})


def test_a_merged_export_lives_beside_its_checkpoint_and_goes_when_it_is_deleted_or_overwritten(
        tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    saved(store)
    merged(store)
    assert store.merged_path(OWNER, REF) == tmp_path / "ckpt" / OWNER / "run" / "merged" / "weights" / "step1"
    assert store.merged_record(OWNER, REF) == {"status": "verified"}
    assert (store.merged_path(OWNER, REF) / MERGED_RECORD).is_file()
    assert not (store.existing(OWNER, REF) / "config.json").exists()  # the adapter's downloads stay the adapter's

    saved(store, stamp=2.5, overwrite=True)
    assert store.merged_record(OWNER, REF) is None and not store.merged_path(OWNER, REF).exists()
    merged(store)
    store.delete(OWNER, REF)
    assert not store.merged_path(OWNER, REF).exists()


def test_the_export_summary_reaches_the_metadata_and_listing_of_the_save_it_was_made_from_only(
        tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    saved(store)
    assert not store.update_metadata(OWNER, REF, {"export": {"status": "verified"}}, saved_at=9.9)  # another save
    assert store.update_metadata(OWNER, REF, {"export": {"status": "verified"}}, saved_at=1.5)
    metadata = store.metadata(OWNER, REF)
    assert metadata["export"] == {"status": "verified"} and metadata["base_model"] == "tiny"
    assert index_entry(REF, metadata, None)["export"] == {"status": "verified"}
    assert "export" not in index_entry(REF, {"base_model": "tiny"}, None)
    assert json.loads((store.existing(OWNER, REF) / "checkpoint_metadata.json").read_text())["time"] == 1.5
