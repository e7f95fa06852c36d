"""RestClient routes (docs/tinker_protocol.md#restclient): training runs and their checkpoints."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter

from api.context import ApiContext
from api.deps import Ctx, Tenant
from api.schemas import TtlBody, WeightsInfoBody
from twinkle.checkpoints import CHECKPOINT_TYPES, CheckpointRef, parse_checkpoint_path, validate_name
from twinkle.errors import InvalidRequest, NotFound
from twinkle.records import ModelRecord

router = APIRouter()


async def _run_json(ctx: ApiContext, record: ModelRecord) -> dict[str, Any]:
    checkpoints = {c["tinker_path"]: c for c in await ctx.store.checkpoints(record.model_id)}
    return {
        "training_run_id": record.model_id,
        "base_model": record.base_model,
        "model_owner": record.owner,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": record.lora.get("rank"),
        "last_request_time": datetime.fromtimestamp(record.last_request_at or record.created_at, UTC).isoformat(),
        "last_checkpoint": checkpoints.get(record.last_checkpoint),
        "last_sampler_checkpoint": checkpoints.get(record.last_sampler_checkpoint),
        "user_metadata": {k: str(v) for k, v in record.user_metadata.items()} or None,
    }


@router.get("/training_runs")
async def list_training_runs(ctx: Ctx, tenant: Tenant, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    runs = await ctx.store.list_runs(tenant)
    page = runs[max(0, offset) : max(0, offset) + max(0, min(limit, 1000))]
    return {"training_runs": [await _run_json(ctx, r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    return await _run_json(ctx, await ctx.store.model(run_id, tenant, active=False))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await ctx.store.model(run_id, tenant, active=False)
    return {"checkpoints": await ctx.store.checkpoints(run_id)}


@router.get("/checkpoints")
async def list_user_checkpoints(ctx: Ctx, tenant: Tenant, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    for run in await ctx.store.list_runs(tenant):
        entries.extend(await ctx.store.checkpoints(run.model_id))
    entries.sort(key=lambda c: c["time"], reverse=True)
    return {"checkpoints": entries[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(entries)}}


def _ref(run_id: str, checkpoint_id: str) -> CheckpointRef:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in CHECKPOINT_TYPES or not name:
        raise InvalidRequest(f"Unknown checkpoint id {checkpoint_id!r}.", hint="Use weights/<name>, "
                             "sampler_weights/<name> or external_weights/<name> as listed by list_checkpoints.")
    return CheckpointRef(validate_name(run_id, "run id"), kind, validate_name(name))  # type: ignore[arg-type]


async def _owned_entry(ctx: ApiContext, tenant: str, ref: CheckpointRef) -> dict[str, Any]:
    await ctx.store.model(ref.run_id, tenant, active=False)
    raw = await ctx.store.r.hget(ctx.keys.checkpoints(ref.run_id), ref.checkpoint_id)
    if raw is None:
        raise NotFound(f"Checkpoint {ref.uri()} not found.")
    entry: dict[str, Any] = json.loads(raw)
    return entry


async def _set_public(ctx: ApiContext, tenant: str, run_id: str, checkpoint_id: str, public: bool) -> None:
    ref = _ref(run_id, checkpoint_id)
    entry = await _owned_entry(ctx, tenant, ref)
    entry["public"] = public
    await ctx.store.r.hset(ctx.keys.checkpoints(ref.run_id), ref.checkpoint_id, json.dumps(entry))


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await _set_public(ctx, tenant, run_id, checkpoint_id, True)
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def unpublish_checkpoint(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await _set_public(ctx, tenant, run_id, checkpoint_id, False)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(run_id: str, checkpoint_id: str, body: TtlBody, ctx: Ctx, tenant: Tenant
                             ) -> dict[str, Any]:
    ref = _ref(run_id, checkpoint_id)
    entry = await _owned_entry(ctx, tenant, ref)
    expires = datetime.now(UTC) + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds else None
    entry["expires_at"] = expires.isoformat() if expires else None
    await ctx.store.r.hset(ctx.keys.checkpoints(ref.run_id), ref.checkpoint_id, json.dumps(entry))
    return {}


@router.post("/weights_info")
async def weights_info(body: WeightsInfoBody, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    ref = parse_checkpoint_path(body.tinker_path)
    metadata = ctx.checkpoints.metadata(tenant, ref)
    lora = metadata.get("lora") or {}
    return {"base_model": metadata.get("base_model", ""), "is_lora": True, "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn")}


# Registered last: its greedy path would otherwise swallow ".../publish" (DELETE = unpublish).
@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    ref = _ref(run_id, checkpoint_id)
    await _owned_entry(ctx, tenant, ref)
    if ctx.export_store is not None:  # first: a store that refuses leaves the checkpoint, so a retry can finish
        await asyncio.to_thread(ctx.export_store.delete, tenant, ref)
    ctx.checkpoints.delete(tenant, ref)
    await ctx.store.r.hdel(ctx.keys.checkpoints(ref.run_id), ref.checkpoint_id)
    return {}
