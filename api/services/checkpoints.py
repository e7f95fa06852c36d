"""Checkpoints for every protocol: saving one (a counted write), a checkpoint's merged export, and the checkpoint
index of each training run that the RestClient routes, the console and `/v1/models` read (listing, publishing,
TTLs, deletion). Copies and imported adapters are api/services/checkpoint_copies.py's and adapter_imports.py's."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from api.context import ApiContext
from twinkle import merged_export
from twinkle.checkpoints import CHECKPOINT_TYPES, CheckpointRef, parse_checkpoint_path, validate_name
from twinkle.errors import InvalidRequest, NotFound
from twinkle.futures import Op, new_request_id
from twinkle.records import ModelRecord
from twinkle.tenancy import TenantPolicy


async def save(ctx: ApiContext, tenant: str, policy: TenantPolicy, record: ModelRecord, op: str, payload: Any,
               seq_id: int | None = None) -> str:
    """Submit a checkpoint save of `record`: checked against the key's quotas, counted against its rate limits
    on its pool and against its outstanding saves (api/checkpoint_writes.py)."""
    await ctx.quotas.check(tenant, policy, op)
    request_id = new_request_id()
    if ctx.writes is not None:
        await ctx.writes.reserve(tenant, request_id)
    try:
        await ctx.limiter.admit(tenant, record.queue)
        winner = await ctx.store.submit(op=op, owner=tenant, model_id=record.model_id, queue=record.queue,
                                        payload=payload, seq_id=seq_id, request_id=request_id,
                                        weight=policy.weight)
    except BaseException:
        if ctx.writes is not None:
            await ctx.writes.release(tenant, request_id)
        raise
    if winner != request_id and ctx.writes is not None:  # a retried save: the first one is counted already
        await ctx.writes.release(tenant, request_id)
    return winner


async def export_merged(ctx: ApiContext, tenant: str, policy: TenantPolicy, path: str) -> tuple[str, CheckpointRef]:
    """Merge a checkpoint's LoRA into the base weights on its model's pool, checked before it is offered
    (twinkle.merged_export); the future's id. One merge per checkpoint: a request while one runs gets its future, a
    later one the recorded result. Counted like a checkpoint save (quotas, rate, outstanding writes)."""
    ref = parse_checkpoint_path(path)
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
    # A failed attempt (a full disk, no free LoRA slot) is not the answer for good: this request runs the op
    # again, which answers a recorded verification failure from its record.
    await ctx.store.forget_failed_dedupe(scope, version)
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
    return winner, ref


def _saved_version(metadata: dict[str, Any]) -> int:
    """Which save of the checkpoint this is (an overwritten training checkpoint is merged again)."""
    try:
        return int(float(metadata.get("time") or 0) * 1e6)
    except (TypeError, ValueError):
        return 0


async def of_run(ctx: ApiContext, tenant: str, run_id: str) -> list[dict[str, Any]]:
    """The index entries of the caller's run (NotFound unless its own), oldest first."""
    await ctx.store.model(run_id, tenant, active=False)
    return await ctx.store.checkpoints(run_id)


async def of_tenant(ctx: ApiContext, tenant: str) -> list[dict[str, Any]]:
    """The index entries of every run of the caller, newest first."""
    entries: list[dict[str, Any]] = []
    for run in await ctx.store.list_runs(tenant):
        entries.extend(await ctx.store.checkpoints(run.model_id))
    entries.sort(key=lambda c: c["time"], reverse=True)
    return entries


async def sampler_paths(ctx: ApiContext, tenant: str, run: str | None = None) -> list[tuple[float, str]]:
    """(saved at, tinker path) of the caller's sampler checkpoints, newest first: of every run, or of `run`
    (NotFound unless the caller's)."""
    if run is not None:
        await ctx.store.model(run, tenant, active=False)
        runs = [run]
    else:
        runs = [record.model_id for record in await ctx.store.list_runs(tenant)]
    paths = [(_created(entry.get("time")), str(entry["tinker_path"]))
             for model_id in runs for entry in await ctx.store.checkpoints(model_id)
             if entry.get("checkpoint_type") == "sampler"]
    return sorted(paths, reverse=True)


def _created(when: Any) -> float:
    """A checkpoint's time (ISO 8601 in the index, or seconds) as seconds since the epoch; 0 when unknown."""
    if isinstance(when, int | float):
        return float(when)
    try:
        return datetime.fromisoformat(str(when)).timestamp()
    except ValueError:
        return 0.0


def indexed_ref(run_id: str, checkpoint_id: str) -> CheckpointRef:
    """The checkpoint a RestClient route names by run and checkpoint id (`weights/<name>`, ...)."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in CHECKPOINT_TYPES or not name:
        raise InvalidRequest(f"Unknown checkpoint id {checkpoint_id!r}.", hint="Use weights/<name>, "
                             "sampler_weights/<name> or external_weights/<name> as listed by list_checkpoints.")
    return CheckpointRef(validate_name(run_id, "run id"), kind, validate_name(name))  # type: ignore[arg-type]


async def _owned_entry(ctx: ApiContext, tenant: str, ref: CheckpointRef) -> dict[str, Any]:
    await ctx.store.model(ref.run_id, tenant, active=False)
    entry = await ctx.store.checkpoint_entry(ref.run_id, ref.checkpoint_id)
    if entry is None:
        raise NotFound(f"Checkpoint {ref.uri()} not found.")
    return entry


async def set_public(ctx: ApiContext, tenant: str, run_id: str, checkpoint_id: str, public: bool) -> None:
    ref = indexed_ref(run_id, checkpoint_id)
    entry = await _owned_entry(ctx, tenant, ref)
    entry["public"] = public
    await ctx.store.put_checkpoint_entry(ref.run_id, ref.checkpoint_id, entry)


async def set_ttl(ctx: ApiContext, tenant: str, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
    """Expire the checkpoint `ttl_seconds` from now (never, without)."""
    ref = indexed_ref(run_id, checkpoint_id)
    entry = await _owned_entry(ctx, tenant, ref)
    expires = datetime.now(UTC) + timedelta(seconds=ttl_seconds) if ttl_seconds else None
    entry["expires_at"] = expires.isoformat() if expires else None
    await ctx.store.put_checkpoint_entry(ref.run_id, ref.checkpoint_id, entry)


async def delete(ctx: ApiContext, tenant: str, run_id: str, checkpoint_id: str) -> None:
    """Delete the checkpoint's files (and its copy in the export store) and its index entry."""
    ref = indexed_ref(run_id, checkpoint_id)
    await _owned_entry(ctx, tenant, ref)
    if ctx.export_store is not None:  # first: a store that refuses leaves the checkpoint, so a retry can finish
        await asyncio.to_thread(ctx.export_store.delete, tenant, ref)
    ctx.checkpoints.delete(tenant, ref)
    await ctx.store.delete_checkpoint_entry(ref.run_id, ref.checkpoint_id)
