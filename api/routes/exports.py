"""Weights that leave the training loop: save_weights_external and export_merged (futures) and copy_weights
(plain reply)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header

from api.checkpoint_writes import submit_save
from api.context import ApiContext
from api.deps import Ctx, Policy, Tenant
from api.schemas import CopyWeightsBody, ExportMergedBody, SaveWeightsExternalBody
from twinkle import merged_export
from twinkle.checkpoints import METADATA_FILE, CheckpointRef, index_entry, parse_checkpoint_path, validate_name
from twinkle.encryption import parse_recipients
from twinkle.errors import InvalidRequest, NotFound
from twinkle.futures import FutureStatus, Op, new_request_id
from twinkle.records import ModelRecord
from twinkle.types import SaveRequest

router = APIRouter()
IDEMPOTENCY_TTL_SECONDS = 86400


@router.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsExternalBody, ctx: Ctx, tenant: Tenant,
                                policy: Policy) -> dict[str, Any]:
    record = await ctx.store.model(body.model_id, tenant)
    recipients = tuple(body.age_encryption_recipients or ())
    parse_recipients(recipients)  # a bad key is a 400 now, not a failed future later
    req = SaveRequest(name=validate_name(body.path), kind="external_weights", include_optimizer=False,
                      ttl_seconds=body.ttl_seconds, age_recipients=recipients)
    rid = await submit_save(ctx, tenant, policy, record, Op.SAVE_WEIGHTS_EXTERNAL, req, seq_id=body.seq_id)
    return {"request_id": rid, "model_id": record.model_id}


@router.post("/export_merged")
async def export_merged(body: ExportMergedBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    """Merge a checkpoint's LoRA into the base weights on its model's pool, checked before it is offered
    (twinkle.merged_export); a future. One merge per checkpoint: a request while one runs gets its future, a
    later one the recorded result. Counted like a checkpoint save (quotas, rate, outstanding writes)."""
    ref = parse_checkpoint_path(body.path)
    run = await ctx.store.model(ref.run_id, tenant, active=False)  # another tenant's run: 404
    metadata = await asyncio.to_thread(ctx.checkpoints.metadata, tenant, ref)
    served = ctx.catalog.find(str(metadata.get("base_model") or run.base_model))
    refused = merged_export.refusal(served.backend, served.name)
    if refused is not None:
        raise refused
    if not served.model_queues:
        raise InvalidRequest(f"{served.name} has no model pool here to merge {ref.uri()} on.")
    queue = run.queue if run.queue in served.model_queues else served.model_queues[0]
    scope, version = f"export_merged:{tenant}:{ref.uri()}", _saved_version(metadata)
    await _forget_failed_attempt(ctx, tenant, scope, version)
    await ctx.quotas.check(tenant, policy, Op.EXPORT_MERGED)
    request_id = new_request_id()
    if ctx.writes is not None:
        await ctx.writes.reserve(tenant, request_id)
    try:
        await ctx.limiter.admit(tenant, queue)
        winner = await ctx.store.submit(op=Op.EXPORT_MERGED, owner=tenant, model_id="", queue=queue,
                                        payload={"path": ref.uri()}, seq_id=version, dedupe_scope=scope,
                                        request_id=request_id, weight=policy.weight)
    except BaseException:
        if ctx.writes is not None:
            await ctx.writes.release(tenant, request_id)
        raise
    if winner != request_id and ctx.writes is not None:  # the merge already asked for: counted once
        await ctx.writes.release(tenant, request_id)
    return {"request_id": winner, "path": ref.uri()}


def _saved_version(metadata: dict[str, Any]) -> int:
    """Which save of the checkpoint this is (an overwritten training checkpoint is merged again)."""
    try:
        return int(float(metadata.get("time") or 0) * 1e6)
    except (TypeError, ValueError):
        return 0


async def _forget_failed_attempt(ctx: ApiContext, tenant: str, scope: str, version: int) -> None:
    """A failed attempt (a full disk, no free LoRA slot) is not the answer for good: the next request runs the op
    again, which answers a recorded verification failure from its record."""
    key = ctx.keys.dedupe(scope, version)
    previous = await ctx.store.r.get(key)
    if previous is None:
        return
    status = await ctx.store.r.hget(ctx.keys.future(previous.decode() if isinstance(previous, bytes)
                                                    else str(previous)), "status")
    if status is None or (status.decode() if isinstance(status, bytes) else str(status)) == FutureStatus.FAILED:
        await ctx.store.r.delete(key)


@router.post("/copy_weights")
async def copy_weights(
    body: CopyWeightsBody, ctx: Ctx, tenant: Tenant,
    x_idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    x_tinker_weights_access_token: Annotated[str | None, Header()] = None,
) -> dict[str, str]:
    """A new training run holding the checkpoint under the same kind and name; files are hard links.

    The SDK sends one idempotency key across all retries of a call, so a retried copy answers the
    first copy's path instead of making a second one.
    """
    if body.weights_access_token or x_tinker_weights_access_token:
        raise InvalidRequest("Copying weights from another account is not supported.",
                             hint="Copy checkpoints of your own API key (leave weights_access_token unset).")
    source = parse_checkpoint_path(body.source_path)
    source_dir = ctx.checkpoints.existing(tenant, source)
    idempotency = ctx.keys.idempotency(tenant, f"copy_weights:{x_idempotency_key}") if x_idempotency_key else None
    if idempotency and (done := await ctx.store.r.get(idempotency)):
        return {"tinker_path": done.decode() if isinstance(done, bytes) else str(done)}
    await _admit_copy(ctx, tenant, source)
    run_id, session_id = await _destination_run(ctx, tenant, body)
    target = CheckpointRef(run_id, source.kind, source.name)
    metadata = await asyncio.to_thread(_link_checkpoint, ctx, tenant, source_dir, target, body.source_path)
    now = time.time()
    run = ModelRecord(
        model_id=run_id, owner=tenant, session_id=session_id, base_model=str(metadata.get("base_model", "")),
        app="", queue="", lora=dict(metadata.get("lora") or {}), created_at=now, last_request_at=now,
        status="unloaded", unload_reason=f"a copy of {body.source_path}; load it into a new training client "
        "to train on it", user_metadata={"copied_from": body.source_path,
                                         **({"project_id": body.destination_project_id}
                                            if body.destination_project_id else {})},
        last_checkpoint=target.uri() if target.kind == "weights" else "",
        last_sampler_checkpoint=target.uri() if target.kind == "sampler_weights" else "",
    )
    pipe = ctx.store.r.pipeline()
    pipe.hset(ctx.keys.model(run_id), mapping=run.to_hash())
    pipe.sadd(ctx.keys.owner_runs(tenant), run_id)  # listed as a run; never holds a LoRA slot
    pipe.hset(ctx.keys.checkpoints(run_id), target.checkpoint_id,
              json.dumps(index_entry(target, metadata, body.ttl_seconds)))
    if idempotency:
        pipe.set(idempotency, target.uri(), ex=IDEMPOTENCY_TTL_SECONDS)
    await pipe.execute()
    return {"tinker_path": target.uri()}


async def _admit_copy(ctx: ApiContext, tenant: str, source: CheckpointRef) -> None:
    """A copy counts against the key's rate on the pool of the checkpoint's base model (a retried copy, answered
    from its idempotency key above, does not)."""
    try:
        served = ctx.catalog.find(str(ctx.checkpoints.metadata(tenant, source).get("base_model", "")))
    except NotFound:
        return  # a base model no longer served has no pool whose limits apply
    if served.model_queues:
        await ctx.limiter.admit(tenant, served.model_queues[0])


async def _destination_run(ctx: ApiContext, tenant: str, body: CopyWeightsBody) -> tuple[str, str]:
    """The new run's id (and session): the session's slot when given, else a fresh run of its own."""
    if body.session_id is not None or body.model_seq_id is not None:
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidRequest("copy_weights needs both session_id and model_seq_id, or neither.")
        await ctx.store.session(body.session_id, tenant)
        run_id = validate_name(f"{body.session_id}:train:{body.model_seq_id}", "run id")
        if await ctx.store.r.exists(ctx.keys.model(run_id)):
            raise InvalidRequest(f"Training run {run_id} already exists.",
                                 hint="Use the session's next model_seq_id for the copy.")
        return run_id, body.session_id
    if not body.destination_project_id:
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
