"""A tenant's PEFT LoRA adapter imported as checkpoints of its own (`POST /import_adapter`, api/routes/imports.py).

The archive is streamed to disk as it arrives; `twinkle.adapter_import` checks everything in it against the
shapes the base model's pool published. The adapter becomes a new training run of the caller (`import-<hex>`,
status unloaded, like a copy) holding `weights/<name>` and `sampler_weights/<name>` (hard links to the same two
files), both in the checkpoint index. An import counts as one of the key's outstanding checkpoint writes while
it runs, and leaves nothing behind when it fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from api.context import ApiContext
from twinkle import adapter_import
from twinkle.adapter_import import AdapterUpload, ModuleShapes
from twinkle.catalog import ServedModel
from twinkle.checkpoints import CheckpointRef, index_entry
from twinkle.errors import InvalidRequest
from twinkle.futures import Op, new_request_id
from twinkle.records import ModelRecord
from twinkle.tenancy import TenantPolicy
from twinkle.types import LoraSpec

WRITE_BUFFER = 4 << 20  # bytes gathered before each write to disk, off the event loop
ARCHIVE = ".upload"
STAGING = ".staging"


@dataclass(frozen=True)
class AdapterImport:
    weights: CheckpointRef
    sampler: CheckpointRef
    served: ServedModel
    spec: LoraSpec
    metadata: dict[str, Any]
    upload: AdapterUpload


async def import_adapter(ctx: ApiContext, tenant: str, policy: TenantPolicy, body: AsyncIterable[bytes], *,
                         checkpoint_name: str, base_model: str | None, ttl_seconds: int | None) -> AdapterImport:
    """Import the adapter archive `body`; its base model is `base_model`, else the one its config declares."""
    served = ctx.catalog.find(base_model) if base_model else None
    shapes = await _module_shapes(ctx, served) if served else None  # refused before a byte is read
    await ctx.quotas.check(tenant, policy, Op.SAVE_STATE)
    if served is not None:
        await _admit(ctx, tenant, served)
    reservation = new_request_id()  # counts as one of the key's outstanding checkpoint writes while it runs
    if ctx.writes is not None:
        await ctx.writes.reserve(tenant, reservation)
    run_id = f"import-{uuid.uuid4().hex[:16]}"
    weights = CheckpointRef(run_id, "weights", checkpoint_name)
    sampler = CheckpointRef(run_id, "sampler_weights", checkpoint_name)
    max_bytes = int(ctx.config.storage.max_adapter_upload_bytes)
    committed: list[CheckpointRef] = []
    try:
        tmp = ctx.checkpoints.begin(tenant, weights)
        try:
            await _receive(body, tmp / ARCHIVE)
            upload = await asyncio.to_thread(adapter_import.parse_upload, tmp / ARCHIVE, tmp / STAGING,
                                             max_bytes=max_bytes)
            if served is None:
                served = adapter_import.find_base_model(ctx.catalog, None, upload.declared_base)
                shapes = await _module_shapes(ctx, served)
                await _admit(ctx, tenant, served)
            assert shapes is not None
            spec = adapter_import.check_against_base(upload, shapes, served.name)
            metadata = await asyncio.to_thread(_store, ctx, tenant, tmp, upload, spec, served, weights, sampler,
                                               committed)
            await _record_run(ctx, tenant, served, spec, metadata, weights, sampler, ttl_seconds)
        except BaseException:
            await asyncio.to_thread(_discard, ctx, tenant, tmp, committed, run_id)
            raise
    finally:
        if ctx.writes is not None:
            await ctx.writes.release(tenant, reservation)
    return AdapterImport(weights, sampler, served, spec, metadata, upload)


async def _module_shapes(ctx: ApiContext, served: ServedModel) -> ModuleShapes:
    """The linear layers the base model's pool published, or a 400 saying why adapters cannot be imported."""
    app = served.model_app or served.sampler_app
    published = await ctx.pools.lora_modules(app) if app else None
    if published is None:
        backend = served.backend or "this"
        raise InvalidRequest(f"Adapters cannot be imported for {served.name}: its pool does not hold a transformers "
                             f"model in one process ({backend} backend), or has not started yet.",
                             hint="Import PEFT adapters into a model served by the transformers backend (one "
                             "process per pool); if it is starting, retry in a minute.")
    return ModuleShapes.from_json(published)


async def _admit(ctx: ApiContext, tenant: str, served: ServedModel) -> None:
    """An import counts against the key's rate on its base model's pool, as a copy does."""
    queue = served.model_queues[0] if served.model_queues else served.sampler_queue
    if queue:
        await ctx.limiter.admit(tenant, queue)


async def _receive(body: AsyncIterable[bytes], path: Path) -> None:
    """Stream the body to `path`; the size limit is enforced while it arrives (api.body_limit)."""
    buffer = bytearray()
    with path.open("wb") as out:
        async for chunk in body:
            buffer += chunk
            if len(buffer) >= WRITE_BUFFER:
                await asyncio.to_thread(out.write, bytes(buffer))
                buffer.clear()
        if buffer:
            await asyncio.to_thread(out.write, bytes(buffer))
    if path.stat().st_size == 0:
        raise InvalidRequest("The upload is empty.", hint="Send a tar archive of adapter_config.json and "
                             "adapter_model.safetensors as the body (Content-Type: application/x-tar).")


def _store(ctx: ApiContext, tenant: str, tmp: Path, upload: AdapterUpload, spec: LoraSpec, served: ServedModel,
           weights: CheckpointRef, sampler: CheckpointRef, committed: list[CheckpointRef]) -> dict[str, Any]:
    """Write the normalized adapter into `tmp`, commit it as the training checkpoint, and link its files into
    the sampler checkpoint; `committed` lists what exists, for the caller to remove on failure."""
    sha256 = adapter_import.write_adapter(upload, spec, served.name, tmp)
    (tmp / ARCHIVE).unlink()
    shutil.rmtree(tmp / STAGING)
    now = time.time()
    metadata: dict[str, Any] = {
        "checkpoint_id": weights.checkpoint_id, "checkpoint_type": weights.checkpoint_type,
        "tinker_path": weights.uri(), "run_id": weights.run_id, "base_model": served.name, "lora": asdict(spec),
        "include_optimizer": False, "user_metadata": {}, "time": now,
        "imported": {"declared_base_model": upload.declared_base, "adapter_sha256": sha256},
    }
    metadata = ctx.checkpoints.commit(tenant, weights, tmp, metadata)
    committed.append(weights)
    source = ctx.checkpoints.existing(tenant, weights)
    linked = ctx.checkpoints.begin(tenant, sampler)
    try:
        for file_name in (adapter_import.CONFIG_FILE, adapter_import.WEIGHTS_FILE):
            try:
                os.link(source / file_name, linked / file_name)  # checkpoints are never written in place
            except OSError:
                shutil.copy2(source / file_name, linked / file_name)
        ctx.checkpoints.commit(tenant, sampler, linked, {
            **metadata, "checkpoint_id": sampler.checkpoint_id, "checkpoint_type": sampler.checkpoint_type,
            "tinker_path": sampler.uri()})
    except BaseException:
        ctx.checkpoints.abort(linked)
        raise
    committed.append(sampler)
    return metadata


def _discard(ctx: ApiContext, tenant: str, tmp: Path, committed: list[CheckpointRef], run_id: str) -> None:
    """Leave nothing of a failed import: its temp directory, what it committed, its empty run directory."""
    ctx.checkpoints.abort(tmp)
    for ref in committed:
        ctx.checkpoints.delete(tenant, ref)
    run_dir = ctx.checkpoints.tenant_dir(tenant) / run_id
    for directory in (run_dir / "weights", run_dir / "sampler_weights", run_dir):
        try:
            directory.rmdir()
        except OSError:
            pass  # not empty, or never made


async def _record_run(ctx: ApiContext, tenant: str, served: ServedModel, spec: LoraSpec, metadata: dict[str, Any],
                      weights: CheckpointRef, sampler: CheckpointRef, ttl_seconds: int | None) -> None:
    """The run and its two checkpoints in Redis, where the RestClient routes and /v1/models list them."""
    now = time.time()
    run = ModelRecord(
        model_id=weights.run_id, owner=tenant, session_id="", base_model=served.name, app="", queue="",
        lora=asdict(spec), created_at=now, last_request_at=now, status="unloaded",
        unload_reason="an imported adapter; load it into a new training client to train on it",
        user_metadata={"imported_from": str(metadata["imported"]["declared_base_model"] or "an upload")},
        last_checkpoint=weights.uri(),
        last_sampler_checkpoint=sampler.uri(),
    )
    await ctx.store.add_unloaded_run(run, {ref.checkpoint_id: index_entry(ref, metadata, ttl_seconds)
                                           for ref in (weights, sampler)})
