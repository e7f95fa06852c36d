"""The `export_merged` op of a model pool: merge a checkpoint's LoRA into the base weights, check it, keep it.

See twinkle.merged_export for what an export is and how it is checked. Here: the pool's side. The reference
logprobs come from this pool's backend (the checkpoint loaded into a temporary adapter, one forward with
cross_entropy, the adapter removed again); the merge itself (twinkle.backends.hf.merge, imported only when an
export runs) loads its own copy of the base weights on the CPU. A committed export is answered from its record
on every later request, so a checkpoint is merged once; its summary goes into the checkpoint's metadata and its
listing in Redis.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from twinkle import merged_export
from twinkle.checkpoints import CheckpointRef, CheckpointStore, parse_checkpoint_path
from twinkle.config.export import ExportConfig
from twinkle.errors import ExportVerificationFailed, InvalidRequest, LimitExceeded, NotFound
from twinkle.full_checkpoint import is_full_checkpoint
from twinkle.futures import FutureRecord
from twinkle.keys import Keys
from twinkle.types import Datum, ForwardBackwardInput, LoraSpec, chunks_from_tokens, lora_spec_from_dict

log = logging.getLogger("twinkle.worker")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class ExportSettings:
    """What a model pool needs to know to make merged exports."""

    backend: str  # the pool's backend name (transformers, megatron, mock)
    model_id: str  # where the base model's files are (a local directory, hf://, ms://)
    config: ExportConfig
    pool_dtype: str  # the dtype the pool computes in (float32, bfloat16, ...)


class MergedExports:
    def __init__(self, backend: Any, store: CheckpointStore, r: redis.Redis, keys: Keys,
                 settings: ExportSettings | None) -> None:
        self.backend = backend
        self.store = store
        self.r = r
        self.keys = keys
        self.settings = settings
        self.merge: Any = None  # replaces the merge step (twinkle.backends.hf.merge.Merge); tests break it on purpose

    def export(self, rec: FutureRecord, req: dict[str, Any]) -> dict[str, Any]:
        ref = parse_checkpoint_path(str(req["path"]))
        directory = self.store.existing(rec.owner, ref)
        metadata = self.store.metadata(rec.owner, ref)
        saved_at = metadata.get("time")
        done = self.store.merged_record(rec.owner, ref)
        if done is not None and merged_export.is_current(done, saved_at):
            self._publish(rec.owner, ref, done, saved_at)  # again: a crash may have come between commit and this
            return _answer(done)
        if is_full_checkpoint(directory):
            raise InvalidRequest(f"{ref.uri()} is a full-parameter checkpoint: it is a whole model already, with "
                                 "nothing to merge.", hint="Download it as it is (its archive is a Hugging Face "
                                 "model directory).")
        settings = self.settings
        if settings is None:
            raise InvalidRequest("This pool makes no merged exports.")
        refused = merged_export.refusal(settings.backend, str(metadata.get("base_model") or settings.model_id))
        if refused is not None:
            raise refused
        _check_adapter_files(directory, ref)
        rows = merged_export.probe_rows(self.backend.info.vocab_size, self.backend.info.max_context_length)
        reference = self._pool_logprobs(rec, directory, metadata, rows)
        done = self._merge(rec.owner, ref, directory, rows, reference, saved_at, settings)
        if not self._publish(rec.owner, ref, done, saved_at):  # deleted or overwritten meanwhile
            self.store.delete_merged(rec.owner, ref)
            raise NotFound(f"Checkpoint {ref.uri()} was deleted or overwritten while it was merged.",
                           hint="Ask for the merged export of the checkpoint as it is now.")
        log.info("export_merged %s: %s, largest difference %.3g (adapter %.3g), %.1f s", ref.uri(), done["status"],
                 done["merged"]["max_abs_diff"], done["adapter"]["max_abs_diff"], done["seconds"])
        return _answer(done)

    def check_adapter(self, rec: FutureRecord, ref: CheckpointRef) -> dict[str, Any] | None:
        """Check a PEFT adapter export just saved (save_weights_external): its files loaded with
        PeftModel.from_pretrained against the pool's forward; the result goes into the checkpoint's metadata and
        listing. None where this pool does not check (another backend, `verify_adapter_exports` off)."""
        settings = self.settings
        if settings is None or settings.backend != "transformers" or not settings.config.verify_adapter_exports:
            return None
        from twinkle.backends.hf import merge
        from twinkle.backends.hf.loading import model_directory

        directory = self.store.existing(rec.owner, ref)
        metadata = self.store.metadata(rec.owner, ref)
        _check_adapter_files(directory, ref)
        rows = merged_export.probe_rows(self.backend.info.vocab_size, self.backend.info.max_context_length)
        reference = self._pool_logprobs(rec, directory, metadata, rows)
        theirs = merge.adapter_logprobs(model_directory(settings.model_id), directory, rows)
        tolerance = merged_export.tolerance_for(settings.config, pool_dtype=settings.pool_dtype,
                                                export_dtype="float32")
        adapter = merged_export.check(merged_export.max_abs_diff(theirs, reference), tolerance)
        summary = {"status": adapter["status"], "max_abs_diff": adapter["max_abs_diff"], "tolerance": tolerance,
                   "adapter": adapter}
        self._publish_summary(rec.owner, ref, summary, metadata.get("time"))
        log.info("save_weights_external %s: adapter %s, largest difference %.3g", ref.uri(), adapter["status"],
                 adapter["max_abs_diff"])
        return summary

    def _merge(self, owner: str, ref: CheckpointRef, directory: Path, rows: list[list[int]],
               reference: list[np.ndarray], saved_at: Any, settings: ExportSettings) -> dict[str, Any]:
        from twinkle.backends.hf import merge  # torch, transformers, PEFT: only in pools that export
        from twinkle.backends.hf.loading import model_directory

        config = settings.config
        tmp = self.store.begin_merged(owner, ref)
        try:
            out = merge.export_merged(model_directory(settings.model_id), directory, tmp, rows, dtype=config.dtype,
                                      max_shard_size=config.shard_bytes, merge=self.merge)
            tolerance = merged_export.tolerance_for(config, pool_dtype=settings.pool_dtype, export_dtype=out.dtype)
            adapter = merged_export.check(merged_export.max_abs_diff(out.adapter_logprobs, reference), tolerance)
            merged = merged_export.check(merged_export.max_abs_diff(out.merged_logprobs, reference), tolerance)
            done = merged_export.record(ref.uri(), saved_at, tolerance=tolerance, adapter=adapter, merged=merged,
                                        dtype=out.dtype, pool_dtype=settings.pool_dtype, files=out.files,
                                        size_bytes=out.size_bytes, shards=out.shards, seconds=out.seconds)
            if merged["status"] != merged_export.VERIFIED:  # never offered: its weights are not kept
                for path in tmp.iterdir():
                    path.unlink()
            self.store.commit_merged(owner, ref, tmp, done)
        except BaseException:
            self.store.abort(tmp)
            raise
        return done

    def _pool_logprobs(self, rec: FutureRecord, directory: Path, metadata: dict[str, Any],
                       rows: list[list[int]]) -> list[np.ndarray]:
        """The training pool's logprobs of the checkpoint: loaded into a temporary adapter, one forward."""
        adapter_id = f"export:{rec.request_id}"
        try:
            self.backend.create_adapter(adapter_id, _lora_spec(directory, metadata))
        except LimitExceeded as full:
            raise LimitExceeded(f"export_merged checks the merge against this pool's own forward of the checkpoint, "
                                f"which needs a LoRA slot for a moment: {full.message}",
                                hint="Ask again once a slot is free (export_merged retries a failed attempt); "
                                     f"{full.hint or ''}".rstrip("; "), **full.details) from full
        try:
            self.backend.load_state(adapter_id, directory, include_optimizer=False)
            data = [Datum(chunks_from_tokens(row[:-1]), {"target_tokens": np.asarray(row[1:], np.int64),
                                                         "weights": np.ones(len(row) - 1, np.float32)})
                    for row in rows]
            out = self.backend.forward(adapter_id, ForwardBackwardInput(data, "cross_entropy"))
        finally:
            self.backend.remove_adapter(adapter_id)
        return [np.asarray(o["logprobs"], np.float32) for o in out.loss_fn_outputs]

    def _publish(self, owner: str, ref: CheckpointRef, done: dict[str, Any], saved_at: Any) -> bool:
        return self._publish_summary(owner, ref, merged_export.summary(done), saved_at)

    def _publish_summary(self, owner: str, ref: CheckpointRef, summary: dict[str, Any], saved_at: Any) -> bool:
        """The export's summary into the checkpoint's metadata and its listing (list_checkpoints, the console);
        False, and nothing written, when the checkpoint was deleted or overwritten since `saved_at`."""
        if not self.store.update_metadata(owner, ref, {"export": summary}, saved_at=saved_at):
            return False
        key = self.keys.checkpoints(ref.run_id)
        raw = self.r.hget(key, ref.checkpoint_id)
        if raw:
            entry = json.loads(raw)
            if entry.get("export") != summary:
                self.r.hset(key, ref.checkpoint_id, json.dumps({**entry, "export": summary}))
        return True


def _answer(done: dict[str, Any]) -> dict[str, Any]:
    if done["status"] == merged_export.VERIFIED:
        return merged_export.result(done)
    raise ExportVerificationFailed(
        merged_export.failure_message(done),
        hint="The merge does not give the weights you trained; report the checkpoint path to the operator. "
             "The PEFT adapter download is unaffected.",
        max_abs_diff=done["merged"]["max_abs_diff"], tolerance=done["tolerance"])


def _check_adapter_files(directory: Path, ref: CheckpointRef) -> None:
    if all((directory / name).is_file() for name in ADAPTER_FILES):
        return
    if any(path.suffix == ".age" for path in directory.iterdir()):
        raise InvalidRequest(f"Checkpoint {ref.uri()} is encrypted (age), so the server cannot merge it.",
                             hint="Merge a training or sampler checkpoint of the same weights instead.")
    raise InvalidRequest(f"Checkpoint {ref.uri()} holds no PEFT adapter to merge.",
                         hint="Pass a checkpoint written by save_state, save_weights_for_sampler or "
                              "save_weights_external.")


def _lora_spec(directory: Path, metadata: dict[str, Any]) -> LoraSpec:
    """The adapter shape to load the checkpoint into: as its run was created, else as its files say."""
    if metadata.get("lora"):
        return lora_spec_from_dict(metadata["lora"])
    from twinkle.backends.hf.checkpoint import read_lora_spec

    return read_lora_spec(directory)
