"""Training routes (docs/tinker_protocol.md#training): every compute call stores its payload and returns a future."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request

from api import tinker_submits
from api.context import ApiContext
from api.deps import Ctx, Policy, Tenant
from api.responses.answer import described_by
from api.responses.tinker import FutureHandle, ModelInfo, future_handle
from api.schemas import (
    CreateModelBody,
    LoadWeightsBody,
    ModelRef,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
    checked_new_id,
)
from api.services import checkpoints, training
from twinkle.checkpoints import new_checkpoint_name, validate_name
from twinkle.errors import InvalidRequest, PayloadTooLarge
from twinkle.futures import Op
from twinkle.tenancy import TenantPolicy
from twinkle.tokenizer_files import is_hub_style_name
from twinkle.types import TRAINING_MODES, LoraSpec, SaveRequest

router = APIRouter()

# /forward_backward and /forward read their body themselves (protobuf or JSON, maybe zstd), so FastAPI
# cannot infer it; this describes it for the OpenAPI document, its readers and the fuzz test.
_TENSOR = {"type": "object", "required": ["data", "dtype"], "properties": {
    "data": {"type": "array", "items": {"type": "number"}},
    "dtype": {"type": "string", "enum": ["int64", "float32"]},
    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}
_DATUM = {"type": "object", "required": ["model_input"], "properties": {
    "model_input": {"type": "object", "required": ["chunks"], "properties": {"chunks": {"type": "array", "items": {
        "type": "object", "required": ["type", "tokens"], "properties": {
            "type": {"type": "string", "enum": ["encoded_text"]},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}}}},
    "loss_fn_inputs": {"type": "object", "additionalProperties": _TENSOR}}}


def _batch_body(input_key: str) -> dict[str, Any]:
    batch = {"type": "object", "required": ["data", "loss_fn"], "properties": {
        "data": {"type": "array", "items": _DATUM}, "loss_fn": {"type": "string"},
        "loss_fn_config": {"type": "object", "additionalProperties": {"type": ["number", "string"]}}}}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"type": "object", "required": ["model_id", input_key], "properties": {
            "model_id": {"type": "string"}, "seq_id": {"type": "integer", "minimum": 0}, input_key: batch}}},
        "application/x-protobuf": {"schema": {
            "type": "string", "format": "binary",
            "description": "tinker_public.ForwardBackwardRequest (Tinker SDK 0.38); Content-Encoding zstd allowed"}},
    }}}


def training_mode(body: CreateModelBody) -> str:
    """`lora` or `full`, from the body's field or (the Tinker SDK's way) its user_metadata; both must agree."""
    metadata = (body.user_metadata or {}).get("training_mode")
    if metadata is not None and metadata not in TRAINING_MODES:
        raise InvalidRequest(f"user_metadata training_mode must be one of {', '.join(TRAINING_MODES)}, "
                             f"got {metadata!r}.")
    if body.training_mode and metadata and body.training_mode != metadata:
        raise InvalidRequest(f"training_mode {body.training_mode!r} and user_metadata training_mode {metadata!r} "
                             "disagree.", hint="Ask for one mode.")
    return str(body.training_mode or metadata or "lora")


def lora_spec(body_lora: Any, served_model: str) -> LoraSpec:
    if body_lora is None:
        return LoraSpec()
    target = body_lora.target_modules
    return LoraSpec(rank=body_lora.rank, alpha=body_lora.alpha, seed=body_lora.seed,
                    train_mlp=body_lora.train_mlp, train_attn=body_lora.train_attn,
                    train_unembed=body_lora.train_unembed,
                    target_modules=tuple(target) if isinstance(target, list) else target)


@router.post("/create_model", response_model=described_by(FutureHandle))
async def create_model(body: CreateModelBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    if body.optimizer_config and body.optimizer_config.type != "adamw":
        raise InvalidRequest(f"Optimizer {body.optimizer_config.type!r} is not supported.",
                             hint="Use the default AdamW optimizer (optimizer_config type 'adamw').")
    spec = replace(lora_spec(body.lora_config, body.base_model), mode=training_mode(body))
    record, rid = await training.create_model(ctx, tenant, policy, spec, session_id=body.session_id,
                                              model_seq_id=body.model_seq_id, base_model=body.base_model,
                                              user_metadata=body.user_metadata)
    return future_handle(rid, record.model_id)


@router.post("/get_info", response_model=described_by(ModelInfo))
async def get_info(body: ModelRef, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    record, served, info = await training.loaded_model(ctx, tenant, body.model_id)
    return {
        "type": "get_info",
        "model_id": record.model_id,
        "model_data": {"arch": info.get("arch"), "model_name": served.name,
                       "tokenizer_id": _tokenizer_id(served.name, info.get("tokenizer_id"))},
        "is_lora": record.lora.get("mode", "lora") != "full",
        "lora_rank": record.lora.get("rank") if record.lora.get("mode", "lora") != "full" else None,
        "training_mode": record.lora.get("mode", "lora"),
        "model_name": served.name,
    }


def _tokenizer_id(served_name: str, loaded_from: str | None) -> str | None:
    """A hub-style served name (`Qwen/Qwen3-8B`) is what the SDK and cookbook load on a client machine (from
    the hub, or from this server's tokenizer_files through init_tinker_client); the server's own model
    directory means nothing there. Any other name keeps the worker's answer (the model directory)."""
    return served_name if is_hub_style_name(served_name) else loaded_from


async def _forward(request: Request, ctx: ApiContext, tenant: str, policy: TenantPolicy, *,
                   forward_only: bool) -> dict[str, Any]:
    declared = int(request.headers.get("content-length") or 0)
    body = b"" if declared > ctx.max_request_bytes else await request.body()
    if max(declared, len(body)) > ctx.max_request_bytes:
        raise PayloadTooLarge(f"The request body has {max(declared, len(body))} bytes; the limit is "
                              f"{ctx.max_request_bytes}.",
                              hint="Send the batch in smaller chunks.")
    record, rid = await tinker_submits.forward_backward(
        ctx, tenant, policy, body, request.headers.get("content-type", ""), request.headers.get("content-encoding"),
        forward_only=forward_only)
    return future_handle(rid, record.model_id)


@router.post("/forward_backward", response_model=described_by(FutureHandle),
             openapi_extra=_batch_body("forward_backward_input"))
async def forward_backward(request: Request, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await _forward(request, ctx, tenant, policy, forward_only=False)


@router.post("/forward", response_model=described_by(FutureHandle), openapi_extra=_batch_body("forward_input"))
async def forward(request: Request, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await _forward(request, ctx, tenant, policy, forward_only=True)


@router.post("/optim_step", response_model=described_by(FutureHandle))
async def optim_step(body: OptimStepBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    record, rid = await tinker_submits.optim_step(ctx, tenant, policy, body)
    return future_handle(rid, record.model_id)


@router.post("/save_weights", response_model=described_by(FutureHandle))
async def save_weights(body: SaveWeightsBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    record = await ctx.store.model(body.model_id, tenant)
    name = validate_name(body.path) if body.path else new_checkpoint_name()
    req = SaveRequest(name=name, kind="weights", include_optimizer=True, overwrite=body.overwrite,
                      ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata or {})
    rid = await checkpoints.save(ctx, tenant, policy, record, Op.SAVE_STATE, req, seq_id=body.seq_id)
    return future_handle(rid, record.model_id)


@router.post("/save_weights_for_sampler", response_model=described_by(FutureHandle))
async def save_weights_for_sampler(body: SaveWeightsForSamplerBody, ctx: Ctx, tenant: Tenant,
                                   policy: Policy) -> dict[str, Any]:
    record = await ctx.store.model(body.model_id, tenant)
    sampling_session_id = None
    if body.path:
        name = validate_name(body.path)
    else:
        name = new_checkpoint_name("sampler")
        seq = body.sampling_session_seq_id if body.sampling_session_seq_id is not None else int(time.time())
        sampling_session_id = checked_new_id(f"{record.session_id}:sample:{seq}", "sampling session id")
    req = SaveRequest(name=name, kind="sampler_weights", include_optimizer=False, ttl_seconds=body.ttl_seconds,
                      user_metadata=body.user_metadata or {}, sampling_session_id=sampling_session_id)
    rid = await checkpoints.save(ctx, tenant, policy, record, Op.SAVE_WEIGHTS_FOR_SAMPLER, req, seq_id=body.seq_id)
    return future_handle(rid, record.model_id)


@router.post("/load_weights", response_model=described_by(FutureHandle))
async def load_weights(body: LoadWeightsBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    record, rid = await training.load_weights(
        ctx, tenant, policy, body.path, model_id=body.model_id, optimizer=body.optimizer, seq_id=body.seq_id,
        session_id=body.session_id, model_seq_id=body.model_seq_id, base_model=body.base_model,
        user_metadata=body.user_metadata)
    return future_handle(rid, record.model_id)


@router.post("/unload_model", response_model=described_by(FutureHandle))
async def unload_model(body: ModelRef, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    record, rid = await training.unload_model(ctx, tenant, policy, body.model_id)
    return future_handle(rid, record.model_id)
