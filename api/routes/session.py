"""Bootstrap, sessions, capabilities and health (docs/tinker_protocol.md#bootstrap-and-sessions)."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request

from api.deps import Ctx, Policy, Tenant, get_tenant
from api.responses.answer import described_by
from api.responses.tinker import (
    ClientConfig,
    DynamicConfig,
    Empty,
    Health,
    HeartbeatAck,
    ServerCapabilities,
    SessionCreated,
    SessionInfo,
    SessionList,
    TelemetryAck,
)
from api.schemas import CreateSessionBody, FinishBody, SessionRef
from api.services import training
from twinkle.launched_process import INSTANCE_ENV

router = APIRouter()



@router.get("/healthz", response_model=described_by(Health))
async def healthz(ctx: Ctx) -> dict[str, Any]:
    await ctx.store.ping()
    # the launcher that started this API tells its answer from another server's on the same port
    instance = os.environ.get(INSTANCE_ENV)
    return {"status": "ok", **({"instance": instance} if instance else {})}


@router.post("/client/config", response_model=described_by(ClientConfig))
async def client_config(ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    """SDK flags (api/sdk_flags.py): Twinkle's defaults, with whatever TWINKLE_TINKER_CLIENT_CONFIG overrides."""
    return ctx.tinker_client_config


@router.post("/client/dynamic_config", response_model=described_by(DynamicConfig))
async def dynamic_config(tenant: Tenant) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/get_server_capabilities", response_model=described_by(ServerCapabilities))
async def capabilities(request: Request, ctx: Ctx) -> dict[str, Any]:
    # What a server serves is for its users: with keys configured, only a valid key may ask. In development
    # mode (no keys) it stays open, as health checks and first steps use it before choosing a key.
    if not ctx.auth.dev_mode:
        await get_tenant(request, request.headers.get("x-api-key"), request.headers.get("authorization"))
    models = []
    for served in ctx.catalog.models.values():
        info = await ctx.model_info(served)
        max_len = served.max_length or (info or {}).get("max_context_length")
        models.append({"model_name": served.name, "max_context_length": max_len,
                       "trainable": served.trainable, "sampleable": served.sample_queue() is not None})
    return {"supported_models": models}


@router.post("/create_session", response_model=described_by(SessionCreated))
async def create_session(body: CreateSessionBody, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    session = await ctx.store.create_session(tenant, tags=body.tags, user_metadata=body.user_metadata or {},
                                             sdk_version=body.sdk_version)
    return {"type": "create_session", "session_id": session.session_id}


@router.post("/session_heartbeat", response_model=described_by(HeartbeatAck))
async def session_heartbeat(body: SessionRef, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await ctx.store.heartbeat(body.session_id, tenant)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish", response_model=described_by(Empty))
async def finish_session(session_id: str, body: FinishBody, ctx: Ctx, tenant: Tenant,
                         policy: Policy) -> dict[str, Any]:
    """End the session (ServiceClient.close): its models are unloaded at once, so their LoRA slots and the
    key's model count are free for the next run instead of waiting out adapter_timeout."""
    await ctx.store.finish_session(session_id, tenant, body.reason.type)
    await training.unload_session_models(ctx, tenant, policy, session_id, body.reason.type)
    return {}


@router.get("/sessions", response_model=described_by(SessionList))
async def list_sessions(ctx: Ctx, tenant: Tenant, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    sessions = await ctx.store.list_sessions(tenant)
    return {"sessions": sessions[offset : offset + limit]}


@router.get("/sessions/{session_id}", response_model=described_by(SessionInfo))
async def get_session(session_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    session = await ctx.store.session(session_id, tenant)
    runs = [m.model_id for m in await ctx.store.list_runs(tenant) if m.session_id == session_id]
    return {"training_run_ids": runs, "sampler_ids": [], "user_metadata": {
        k: str(v) for k, v in session.user_metadata.items()} or None}


@router.post("/telemetry", response_model=described_by(TelemetryAck))
async def telemetry(tenant: Tenant) -> dict[str, Any]:
    return {"status": "accepted"}
