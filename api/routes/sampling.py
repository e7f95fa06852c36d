"""Sampling routes (docs/tinker_protocol.md#sampling)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api import tinker_submits
from api.deps import Ctx, Policy, Tenant
from api.responses.answer import described_by
from api.responses.tinker import SampleFuture, SamplerInfo, SamplingSessionCreated
from api.schemas import CreateSamplingSessionBody, SampleBody
from api.services import sampling

router = APIRouter()


@router.post("/create_sampling_session", response_model=described_by(SamplingSessionCreated))
async def create_sampling_session(body: CreateSamplingSessionBody, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    record = await sampling.create_sampling_session(ctx, tenant, body.session_id, body.base_model, body.model_path,
                                                    body.sampling_session_seq_id)
    return {"type": "create_sampling_session", "sampling_session_id": record.sampling_session_id}


@router.get("/samplers/{sampler_id}", response_model=described_by(SamplerInfo))
async def get_sampler(sampler_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    record = await ctx.store.sampling_session(sampler_id, tenant)
    return {"sampler_id": record.sampling_session_id, "base_model": record.base_model,
            "model_path": record.model_path or None}


@router.post("/asample", response_model=described_by(SampleFuture))
async def asample(body: SampleBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await tinker_submits.asample(ctx, tenant, policy, body)
