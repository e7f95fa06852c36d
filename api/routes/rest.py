"""RestClient routes (docs/tinker_protocol.md#restclient): training runs and their checkpoints."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter

from api.context import ApiContext
from api.deps import Ctx, Tenant
from api.responses.answer import described_by
from api.responses.tinker import CheckpointList, Empty, TrainingRun, TrainingRunPage, WeightsInfo
from api.schemas import TtlBody, WeightsInfoBody
from api.services import checkpoints
from twinkle.checkpoints import parse_checkpoint_path
from twinkle.records import ModelRecord

router = APIRouter()


async def _run_json(ctx: ApiContext, record: ModelRecord) -> dict[str, Any]:
    by_path = {c["tinker_path"]: c for c in await ctx.store.checkpoints(record.model_id)}
    return {
        "training_run_id": record.model_id,
        "base_model": record.base_model,
        "model_owner": record.owner,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": record.lora.get("rank"),
        "last_request_time": datetime.fromtimestamp(record.last_request_at or record.created_at, UTC).isoformat(),
        "last_checkpoint": by_path.get(record.last_checkpoint),
        "last_sampler_checkpoint": by_path.get(record.last_sampler_checkpoint),
        "user_metadata": {k: str(v) for k, v in record.user_metadata.items()} or None,
    }


@router.get("/training_runs", response_model=described_by(TrainingRunPage))
async def list_training_runs(ctx: Ctx, tenant: Tenant, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    runs = await ctx.store.list_runs(tenant)
    page = runs[max(0, offset) : max(0, offset) + max(0, min(limit, 1000))]
    return {"training_runs": [await _run_json(ctx, r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}


@router.get("/training_runs/{run_id}", response_model=described_by(TrainingRun))
async def get_training_run(run_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    return await _run_json(ctx, await ctx.store.model(run_id, tenant, active=False))


@router.get("/training_runs/{run_id}/checkpoints", response_model=described_by(CheckpointList))
async def list_checkpoints(run_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    return {"checkpoints": await checkpoints.of_run(ctx, tenant, run_id)}


@router.get("/checkpoints", response_model=described_by(CheckpointList))
async def list_user_checkpoints(ctx: Ctx, tenant: Tenant, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    entries = await checkpoints.of_tenant(ctx, tenant)
    return {"checkpoints": entries[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(entries)}}


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", response_model=described_by(Empty))
async def publish_checkpoint(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await checkpoints.set_public(ctx, tenant, run_id, checkpoint_id, True)
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", response_model=described_by(Empty))
async def unpublish_checkpoint(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await checkpoints.set_public(ctx, tenant, run_id, checkpoint_id, False)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl", response_model=described_by(Empty))
async def set_checkpoint_ttl(run_id: str, checkpoint_id: str, body: TtlBody, ctx: Ctx, tenant: Tenant
                             ) -> dict[str, Any]:
    await checkpoints.set_ttl(ctx, tenant, run_id, checkpoint_id, body.ttl_seconds)
    return {}


@router.post("/weights_info", response_model=described_by(WeightsInfo))
async def weights_info(body: WeightsInfoBody, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    ref = parse_checkpoint_path(body.tinker_path)
    metadata = ctx.checkpoints.metadata(tenant, ref)
    lora = metadata.get("lora") or {}
    return {"base_model": metadata.get("base_model", ""), "is_lora": True, "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn")}


# Registered last: its greedy path would otherwise swallow ".../publish" (DELETE = unpublish).
@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", response_model=described_by(Empty))
async def delete_checkpoint(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await checkpoints.delete(ctx, tenant, run_id, checkpoint_id)
    return {}
