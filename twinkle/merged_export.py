"""Merged exports: a checkpoint's LoRA merged into the base weights, offered as a Hugging Face model directory.

`export_merged` (an op of the model pool that serves the checkpoint's base model) merges the adapter of a
training, sampler or external checkpoint into a fresh copy of the base weights and writes a directory that
`AutoModelForCausalLM.from_pretrained` loads: sharded safetensors, config.json, generation_config.json and the
tokenizer files. It lives beside the checkpoint (twinkle.checkpoints, `merged/<kind>/<name>/`), is made once
per checkpoint (a later request answers the recorded result) and goes when the checkpoint is deleted.

Every export is checked the way a user would load it, on a fixed probe batch: the PEFT adapter files with
`PeftModel.from_pretrained` on the base model, and the merged directory with `from_pretrained`; each one's
logprobs are compared with the training pool's own logprobs of the same checkpoint (a forward of the adapter
with cross_entropy). The largest absolute difference of each is recorded in the checkpoint's metadata (and so
in list_checkpoints and the web console). An export past the tolerance is recorded as failed with its
difference; a failed merged model is never offered for download (its weights are not kept).

This module is the backend-independent part: the probe batch, the comparison and the record. The merge itself
is `twinkle.backends.hf.merge`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle.errors import InvalidRequest

if TYPE_CHECKING:
    from twinkle.config.export import ExportConfig

FORMAT = "twinkle-merged-1"  # a record of another format is made again (a fixed merge is not kept failing)
PROBE_ROWS = 2
PROBE_TOKENS = 33  # per row: 32 predicted tokens
PROBE_SEED = 20261203
VERIFIED = "verified"
FAILED = "failed"


def probe_rows(vocab_size: int, max_length: int | None = None) -> list[list[int]]:
    """The fixed probe batch: token rows drawn from the whole vocabulary (so an output head's LoRA shows),
    the same for every export of a model."""
    length = min(PROBE_TOKENS, max_length or PROBE_TOKENS)
    rng = np.random.default_rng(PROBE_SEED)
    return [[int(t) for t in rng.integers(0, vocab_size, size=length)] for _ in range(PROBE_ROWS)]


def max_abs_diff(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    """The largest absolute difference between two sets of per-row logprobs (inf on a shape mismatch or NaN)."""
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        if a.shape != b.shape:
            return float("inf")
        diff = np.abs(a - b)
        if diff.size and not np.all(np.isfinite(diff)):
            return float("inf")
        worst = max(worst, float(diff.max(initial=0.0)))
    return worst


def check(diff: float, tolerance: float) -> dict[str, Any]:
    return {"status": VERIFIED if diff <= tolerance else FAILED, "max_abs_diff": diff}


def tolerance_for(config: ExportConfig, *, pool_dtype: str, export_dtype: str) -> float:
    """`tolerance` when the pool computes and the export stores float32; `tolerance_16bit` otherwise (16-bit
    rounding alone moves logprobs by about 1e-2, so there the check catches gross errors only)."""
    if pool_dtype == "float32" and export_dtype == "float32":
        return float(config.tolerance)
    return float(config.tolerance_16bit)


def record(path: str, saved_at: Any, *, tolerance: float, adapter: dict[str, Any], merged: dict[str, Any],
           dtype: str, pool_dtype: str, files: list[str], size_bytes: int, shards: int, seconds: float
           ) -> dict[str, Any]:
    """The merged export's record (its directory's record file; `summary` of it goes into the checkpoint)."""
    return {
        "format": FORMAT, "tinker_path": path, "saved_at": saved_at, "time": time.time(),
        "status": merged["status"], "tolerance": tolerance, "adapter": adapter, "merged": merged,
        "dtype": dtype, "pool_dtype": pool_dtype, "probe": {"rows": PROBE_ROWS, "tokens": PROBE_TOKENS},
        "files": files if merged["status"] == VERIFIED else [],
        "size_bytes": size_bytes if merged["status"] == VERIFIED else 0,
        "shards": shards, "seconds": round(seconds, 3),
    }


def summary(rec: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint's metadata and its listing show of the export."""
    return {
        "status": rec["status"],
        "max_abs_diff": max(rec["adapter"]["max_abs_diff"], rec["merged"]["max_abs_diff"]),
        "tolerance": rec["tolerance"],
        "adapter": rec["adapter"],
        "merged": {**rec["merged"], "size_bytes": rec["size_bytes"], "shards": rec["shards"], "dtype": rec["dtype"]},
        "seconds": rec["seconds"],
    }


def is_current(rec: dict[str, Any] | None, saved_at: Any) -> bool:
    """The record belongs to the checkpoint as saved now (not an overwritten one) and to this merge format."""
    return rec is not None and rec.get("format") == FORMAT and rec.get("saved_at") == saved_at


def result(rec: dict[str, Any]) -> dict[str, Any]:
    """The future's result of a verified export."""
    return {"path": rec["tinker_path"], "status": rec["status"], "export": summary(rec), "files": rec["files"],
            "size_bytes": rec["size_bytes"]}


def failure_message(rec: dict[str, Any]) -> str:
    merged = rec["merged"]
    adapter = rec["adapter"]
    parts = [f"The merged model of {rec['tinker_path']} does not reproduce the training pool's logprobs: the "
             f"largest difference on the probe batch is {merged['max_abs_diff']:.3g}, past the tolerance "
             f"{rec['tolerance']:g}, so it is not offered for download."]
    parts.append(f"The PEFT adapter files, loaded with PeftModel.from_pretrained, differ by "
                 f"{adapter['max_abs_diff']:.3g} ({adapter['status']}).")
    return " ".join(parts)


def refusal(backend: str, base_model: str) -> InvalidRequest | None:
    """Why the pool of this backend cannot merge (None: it can); named, for the API and the pool alike."""
    if backend == "transformers":
        return None
    if backend == "megatron":
        return InvalidRequest(
            f"Merged exports are not available for {base_model}: it is served by the megatron backend, which "
            "cannot merge a LoRA adapter into its weights yet.",
            hint="Download the PEFT adapter (save_weights_external, get_external_weights_urls) and merge it "
                 "with PEFT's merge_and_unload, or train on a transformers pool.")
    return InvalidRequest(
        f"Merged exports are not available for {base_model}: it is served by the {backend} backend, which holds "
        "no Hugging Face weights to merge into.", hint="Use a server whose model pool runs the transformers backend.")
