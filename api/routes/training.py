"""Training routes (docs/tinker_protocol.md#training): every compute call stores its payload and returns a future."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request

from api.checkpoint_writes import submit_save
from api.context import ApiContext
from api.deps import Ctx, Policy, Tenant
from api.provenance import check_provenance
from api.reservations import refuse_while_held
from api.schemas import (
    CreateModelBody,
    LoadWeightsBody,
    ModelRef,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
    checked_new_id,
)
from api.tinker_codec import adam_params_from_json, decode_forward_backward
from twinkle.checkpoints import new_checkpoint_name, parse_checkpoint_path, validate_name
from twinkle.errors import InvalidRequest, PayloadTooLarge
from twinkle.futures import Op
from twinkle.losses import validate_loss
from twinkle.records import ModelRecord
from twinkle.tenancy import TenantPolicy
from twinkle.tokenizer_files import is_hub_style_name
from twinkle.types import TRAINING_MODES, LoadRequest, LoraSpec, SaveRequest, input_length, lora_spec_from_dict

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


def _future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"request_id": request_id}
    if model_id:
        body["model_id"] = model_id
    return body


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


def check_same_mode(run_mode: str, checkpoint_mode: str, path: str) -> None:
    """A LoRA run loads LoRA checkpoints and a full run full ones: never one silently as the other."""
    if run_mode != checkpoint_mode:
        raise InvalidRequest(f"{path} is a {checkpoint_mode} checkpoint; this run trains in {run_mode} mode.",
                             hint=f"Create a {checkpoint_mode} run from it: load_weights with session_id, no model_id.")


def lora_spec(body_lora: Any, served_model: str) -> LoraSpec:
    if body_lora is None:
        return LoraSpec()
    target = body_lora.target_modules
    return LoraSpec(rank=body_lora.rank, alpha=body_lora.alpha, seed=body_lora.seed,
                    train_mlp=body_lora.train_mlp, train_attn=body_lora.train_attn,
                    train_unembed=body_lora.train_unembed,
                    target_modules=tuple(target) if isinstance(target, list) else target)


async def _register_model(ctx: ApiContext, tenant: str, policy: TenantPolicy, op: Op, session_id: str,
                          model_seq_id: int | None, base_model: str, spec: LoraSpec,
                          user_metadata: dict[str, Any] | None) -> ModelRecord:
    await ctx.store.session(session_id, tenant)
    served = ctx.catalog.find(base_model)
    if not served.trainable:
        raise InvalidRequest(f"Base model {base_model!r} is served for sampling only.",
                             hint="Pick a model listed as trainable in get_server_capabilities.")
    if spec.full and not served.full_runs:
        raise InvalidRequest(f"Base model {served.name!r} is not open to full-parameter training on this server.",
                             hint="Create a LoRA run (training_mode 'lora'), or ask the operator to enable "
                                  "full_finetune on its model application.")
    seq = model_seq_id if model_seq_id is not None else await ctx.store.next_model_seq(session_id)
    model_id = checked_new_id(f"{session_id}:train:{seq}", "model id")
    raw = await ctx.store.r.hgetall(ctx.keys.model(model_id))
    if raw:  # a retried create: same id, same future (deduped on seq 0)
        return ModelRecord.from_hash(raw)
    queue = await _least_loaded(ctx, served.model_queues)
    if ctx.store.reserving_queues.get(queue) == "refuse":  # before the model counts against the key's limit
        await refuse_while_held(ctx.store.r, ctx.keys, queue, model_id)
    await ctx.quotas.check(tenant, policy, op)
    await ctx.limiter.admit(tenant, queue)  # before the model counts against the key's model limit
    now = time.time()
    record = ModelRecord(model_id=model_id, owner=tenant, session_id=session_id, base_model=served.name,
                         app=served.model_app or "", queue=queue,
                         lora={k: v for k, v in spec.__dict__.items()}, created_at=now, last_request_at=now,
                         user_metadata=user_metadata or {})
    await ctx.store.add_model(record, limit=ctx.per_key_model_limit(), policy=policy)
    return record


async def _least_loaded(ctx: ApiContext, queues: list[str]) -> str:
    """The replica with the most free LoRA slots; the model stays pinned there (its record keeps the queue)."""
    if len(queues) == 1:
        return queues[0]
    pipe = ctx.store.r.pipeline(transaction=False)
    for queue in queues:
        pipe.scard(ctx.keys.pool_assigned(queue))
    held = await pipe.execute()
    return min(zip(held, range(len(queues)), queues, strict=True))[2]


@router.post("/create_model")
async def create_model(body: CreateModelBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    if body.optimizer_config and body.optimizer_config.type != "adamw":
        raise InvalidRequest(f"Optimizer {body.optimizer_config.type!r} is not supported.",
                             hint="Use the default AdamW optimizer (optimizer_config type 'adamw').")
    spec = replace(lora_spec(body.lora_config, body.base_model), mode=training_mode(body))
    record = await _register_model(ctx, tenant, policy, Op.CREATE_MODEL, body.session_id, body.model_seq_id,
                                   body.base_model, spec, body.user_metadata)
    rid = await ctx.store.submit(op=Op.CREATE_MODEL, owner=tenant, model_id=record.model_id,
                                 queue=record.queue, payload=spec, seq_id=0, weight=policy.weight)
    return _future(rid, record.model_id)


@router.post("/get_info")
async def get_info(body: ModelRef, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    record = await ctx.store.model(body.model_id, tenant)
    served = ctx.catalog.find(record.base_model)
    info = await ctx.model_info(served) or {}
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
    meta, batch, _is_proto = decode_forward_backward(
        body, request.headers.get("content-type", ""), request.headers.get("content-encoding"),
        max_bytes=ctx.max_request_bytes, vocab_size=None)
    record = await ctx.store.model(meta.model_id, tenant)
    validate_loss(batch.loss_fn, batch.data, batch.loss_fn_config)
    if batch.loss_fn == "stable_reinforce":
        await check_provenance(ctx.store.r, ctx.keys, tenant, batch.data,
                               meta.provenance or (None,) * len(batch.data))
    await _check_lengths(ctx, record, batch)
    tokens = sum(input_length(d.model_input) for d in batch.data)
    op = Op.FORWARD if (forward_only or meta.forward_only) else Op.FORWARD_BACKWARD
    await ctx.quotas.check(tenant, policy, op)
    await ctx.limiter.admit(tenant, record.queue, input_tokens=tokens)
    rid = await ctx.store.submit(op=op, owner=tenant, model_id=record.model_id, queue=record.queue,
                                 payload=batch, seq_id=meta.seq_id, weight=policy.weight)
    return _future(rid, record.model_id)


async def _check_lengths(ctx: ApiContext, record: ModelRecord, batch: Any) -> None:
    served = ctx.catalog.find(record.base_model)
    info = await ctx.model_info(served) or {}
    limit = served.max_length or info.get("max_context_length")
    vocab = info.get("vocab_size")
    for i, datum in enumerate(batch.data):
        tokens = datum.tokens()
        if limit and len(tokens) > limit:
            raise InvalidRequest(f"data[{i}] has {len(tokens)} tokens; this model accepts at most {limit}.",
                                 hint="Truncate or split the sequence.")
        if not vocab:
            continue
        for where, ids in (("model_input", tokens), ("target_tokens", datum.loss_fn_inputs.get("target_tokens"))):
            if ids is not None and len(ids) and int(ids.max()) >= vocab:
                raise InvalidRequest(f"data[{i}].{where} has token id {int(ids.max())}, outside the vocabulary "
                                     f"(size {vocab}).", hint="Tokenize with the model's tokenizer (get_info).")


@router.post("/forward_backward", openapi_extra=_batch_body("forward_backward_input"))
async def forward_backward(request: Request, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await _forward(request, ctx, tenant, policy, forward_only=False)


@router.post("/forward", openapi_extra=_batch_body("forward_input"))
async def forward(request: Request, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await _forward(request, ctx, tenant, policy, forward_only=True)


@router.post("/optim_step")
async def optim_step(body: OptimStepBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    if body.adam_params is None:
        raise InvalidRequest("optim_step needs adam_params.", hint="Only the Adam optimizer is supported.")
    record = await ctx.store.model(body.model_id, tenant)
    params = adam_params_from_json(body.adam_params.model_dump())
    await ctx.quotas.check(tenant, policy, Op.OPTIM_STEP)
    await ctx.limiter.admit(tenant, record.queue)
    rid = await ctx.store.submit(op=Op.OPTIM_STEP, owner=tenant, model_id=record.model_id,
                                 queue=record.queue, payload=params, seq_id=body.seq_id, weight=policy.weight)
    return _future(rid, record.model_id)


@router.post("/save_weights")
async def save_weights(body: SaveWeightsBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    record = await ctx.store.model(body.model_id, tenant)
    name = validate_name(body.path) if body.path else new_checkpoint_name()
    req = SaveRequest(name=name, kind="weights", include_optimizer=True, overwrite=body.overwrite,
                      ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata or {})
    rid = await submit_save(ctx, tenant, policy, record, Op.SAVE_STATE, req, seq_id=body.seq_id)
    return _future(rid, record.model_id)


@router.post("/save_weights_for_sampler")
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
    rid = await submit_save(ctx, tenant, policy, record, Op.SAVE_WEIGHTS_FOR_SAMPLER, req, seq_id=body.seq_id)
    return _future(rid, record.model_id)


@router.post("/load_weights")
async def load_weights(body: LoadWeightsBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    ref = parse_checkpoint_path(body.path)
    metadata = ctx.checkpoints.metadata(tenant, ref)
    if body.model_id:
        record = await ctx.store.model(body.model_id, tenant)
        check_same_mode(record.lora.get("mode", "lora"), (metadata.get("lora") or {}).get("mode", "lora"), body.path)
        req = LoadRequest(owner=tenant, path=body.path, include_optimizer=body.optimizer)
        await ctx.quotas.check(tenant, policy, Op.LOAD_STATE)
        await ctx.limiter.admit(tenant, record.queue)
        rid = await ctx.store.submit(op=Op.LOAD_STATE, owner=tenant, model_id=record.model_id,
                                     queue=record.queue, payload=req, seq_id=body.seq_id, weight=policy.weight)
        return _future(rid, record.model_id)
    if not body.session_id:
        raise InvalidRequest("load_weights needs model_id, or session_id to create a model from the checkpoint.")
    lora = metadata.get("lora") or {}
    spec = lora_spec_from_dict(lora)
    base_model = body.base_model or metadata.get("base_model") or ""
    record = await _register_model(ctx, tenant, policy, Op.LOAD_STATE, body.session_id, body.model_seq_id,
                                   base_model, spec, body.user_metadata)
    req = LoadRequest(owner=tenant, path=body.path, include_optimizer=body.optimizer, lora=spec)
    rid = await ctx.store.submit(op=Op.LOAD_STATE, owner=tenant, model_id=record.model_id, queue=record.queue,
                                 payload=req, seq_id=0, weight=policy.weight)
    return _future(rid, record.model_id)


@router.post("/unload_model")
async def unload_model(body: ModelRef, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    record = await ctx.store.model(body.model_id, tenant)
    await ctx.limiter.admit(tenant, record.queue)  # no quota refuses an unload: it frees what the key holds
    rid = await ctx.store.submit(op=Op.UNLOAD_MODEL, owner=tenant, model_id=record.model_id,
                                 queue=record.queue, payload=None, weight=policy.weight)
    await ctx.store.release_model(record, reason="unloaded by its owner")
    return _future(rid, record.model_id)
