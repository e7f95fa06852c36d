"""Copies of a tenant's checkpoint (`copy_weights`): a new training run holding the checkpoint under the same kind
and name, its files hard links to the source's. The run is listed with its checkpoint but never trains itself:
loading it into a new training client does."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from api.context import ApiContext
from twinkle.checkpoints import METADATA_FILE, CheckpointRef, index_entry, parse_checkpoint_path, validate_name
from twinkle.errors import InvalidRequest, NotFound
from twinkle.records import ModelRecord

IDEMPOTENCY_TTL_SECONDS = 86400


async def copy_weights(ctx: ApiContext, tenant: str, source_path: str, *, idempotency_key: str | None,
                       session_id: str | None, model_seq_id: int | None, destination_project_id: str | None,
                       ttl_seconds: int | None) -> str:
    """The copy's tinker path. A retried call with the same idempotency key answers the first copy's path
    instead of making a second one."""
    source = parse_checkpoint_path(source_path)
    source_dir = ctx.checkpoints.existing(tenant, source)
    idempotency = ctx.keys.idempotency(tenant, f"copy_weights:{idempotency_key}") if idempotency_key else None
    if idempotency and (done := await ctx.store.idempotent_answer(idempotency)):
        return done
    await _admit_copy(ctx, tenant, source)
    run_id, session_id = await _destination_run(ctx, tenant, session_id, model_seq_id, destination_project_id)
    target = CheckpointRef(run_id, source.kind, source.name)
    metadata = await asyncio.to_thread(_link_checkpoint, ctx, tenant, source_dir, target, source_path)
    now = time.time()
    run = ModelRecord(
        model_id=run_id, owner=tenant, session_id=session_id, base_model=str(metadata.get("base_model", "")),
        app="", queue="", lora=dict(metadata.get("lora") or {}), created_at=now, last_request_at=now,
        status="unloaded", unload_reason=f"a copy of {source_path}; load it into a new training client "
        "to train on it", user_metadata={"copied_from": source_path,
                                         **({"project_id": destination_project_id}
                                            if destination_project_id else {})},
        last_checkpoint=target.uri() if target.kind == "weights" else "",
        last_sampler_checkpoint=target.uri() if target.kind == "sampler_weights" else "",
    )
    await ctx.store.add_unloaded_run(
        run, {target.checkpoint_id: index_entry(target, metadata, ttl_seconds)},
        answer=(idempotency, target.uri(), IDEMPOTENCY_TTL_SECONDS) if idempotency else None)
    return target.uri()


async def _admit_copy(ctx: ApiContext, tenant: str, source: CheckpointRef) -> None:
    """A copy counts against the key's rate on the pool of the checkpoint's base model (a retried copy, answered
    from its idempotency key above, does not)."""
    try:
        served = ctx.catalog.find(str(ctx.checkpoints.metadata(tenant, source).get("base_model", "")))
    except NotFound:
        return  # a base model no longer served has no pool whose limits apply
    if served.model_queues:
        await ctx.limiter.admit(tenant, served.model_queues[0])


async def _destination_run(ctx: ApiContext, tenant: str, session_id: str | None, model_seq_id: int | None,
                           destination_project_id: str | None) -> tuple[str, str]:
    """The new run's id (and session): the session's slot when given, else a fresh run of its own."""
    if session_id is not None or model_seq_id is not None:
        if session_id is None or model_seq_id is None:
            raise InvalidRequest("copy_weights needs both session_id and model_seq_id, or neither.")
        await ctx.store.session(session_id, tenant)
        run_id = validate_name(f"{session_id}:train:{model_seq_id}", "run id")
        if await ctx.store.model_record(run_id) is not None:
            raise InvalidRequest(f"Training run {run_id} already exists.",
                                 hint="Use the session's next model_seq_id for the copy.")
        return run_id, session_id
    if not destination_project_id:
        raise InvalidRequest("copy_weights needs destination_project_id, or session_id and model_seq_id.",
                             hint="Pass a project id (or set TINKER_PROJECT_ID for the SDK).")
    return f"copy-{uuid.uuid4().hex[:16]}", ""


def _link_checkpoint(ctx: ApiContext, tenant: str, source_dir: Path, target: CheckpointRef,
                     source_path: str) -> dict[str, Any]:
    """Hard-link the source's files into the target (a copy where links are impossible), then commit."""
    tmp = ctx.checkpoints.begin(tenant, target)
    try:
        for path in sorted(p for p in source_dir.rglob("*") if p.is_file() and not p.is_symlink()):
            relative = path.relative_to(source_dir)
            if relative.as_posix() == METADATA_FILE:
                continue
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, tmp / relative)  # checkpoints are never written in place: sharing is safe
            except OSError:
                shutil.copy2(path, tmp / relative)
        metadata: dict[str, Any] = json.loads((source_dir / METADATA_FILE).read_text())
        metadata.pop("export", None)  # the source's merged export stays the source's
        metadata.update(checkpoint_id=target.checkpoint_id, tinker_path=target.uri(), run_id=target.run_id,
                        copied_from=source_path, time=time.time())
        return ctx.checkpoints.commit(tenant, target, tmp, metadata)
    except BaseException:
        ctx.checkpoints.abort(tmp)
        raise
