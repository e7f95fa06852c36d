"""Training runs for the Tinker and Twinkle routes alike: creating a model on the least loaded replica, submitting
its ops against the key's quotas and rate limits, loading a checkpoint into it (or a new model from one), and
unloading it. Saving a checkpoint is api/services/checkpoints.py's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from api.context import ApiContext
from api.provenance import Span, check_provenance
from api.schemas import checked_new_id
from twinkle.catalog import ServedModel
from twinkle.checkpoints import parse_checkpoint_path
from twinkle.errors import InvalidRequest
from twinkle.futures import Op
from twinkle.losses import validate_loss
from twinkle.records import ModelRecord
from twinkle.tenancy import TenantPolicy
from twinkle.types import ForwardBackwardInput, LoadRequest, LoraSpec, input_length, lora_spec_from_dict


async def submit_op(ctx: ApiContext, tenant: str, policy: TenantPolicy, record: ModelRecord, op: str, payload: Any,
                    *, seq_id: int | None = None, input_tokens: int = 0, check_model: bool = False) -> str:
    """Submit `op` on the model's replica: checked against the key's quotas, counted against its rate limits
    on that pool. `check_model`: `record` came from `Store.model_to_submit`, and the submit checks it is active."""
    await ctx.quotas.check(tenant, policy, op)
    await ctx.limiter.admit(tenant, record.queue, input_tokens=input_tokens)
    return await ctx.store.submit(op=op, owner=tenant, model_id=record.model_id, queue=record.queue,
                                  payload=payload, seq_id=seq_id, weight=policy.weight, check_model=check_model)


async def submit_to_model(ctx: ApiContext, tenant: str, policy: TenantPolicy, model_id: str, op: str, payload: Any,
                          *, input_tokens: int = 0) -> tuple[ModelRecord, str]:
    """`submit_op` on the caller's active model `model_id`."""
    record = await ctx.store.model(model_id, tenant)
    return record, await submit_op(ctx, tenant, policy, record, op, payload, input_tokens=input_tokens)


async def loaded_model(ctx: ApiContext, tenant: str, model_id: str) -> tuple[ModelRecord, ServedModel, dict[str, Any]]:
    """The caller's active model, the served model it trains, and what its pool published about it."""
    record = await ctx.store.model(model_id, tenant)
    served = ctx.catalog.find(record.base_model)
    return record, served, await ctx.model_info(served) or {}


async def create_model(ctx: ApiContext, tenant: str, policy: TenantPolicy, spec: LoraSpec, *, session_id: str,
                       model_seq_id: int | None, base_model: str,
                       user_metadata: dict[str, Any] | None) -> tuple[ModelRecord, str]:
    record = await register_model(ctx, tenant, policy, Op.CREATE_MODEL, session_id, model_seq_id, base_model, spec,
                                  user_metadata)
    rid = await ctx.store.submit(op=Op.CREATE_MODEL, owner=tenant, model_id=record.model_id, queue=record.queue,
                                 payload=spec, seq_id=0, weight=policy.weight)
    return record, rid


async def register_model(ctx: ApiContext, tenant: str, policy: TenantPolicy, op: Op, session_id: str,
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
    existing = await ctx.store.model_record(model_id)
    if existing is not None:  # a retried create: same id, same future (deduped on seq 0)
        return existing
    queue = await _least_loaded(ctx, served.model_queues)
    if ctx.store.reserving_queues.get(queue) == "refuse":  # before the model counts against the key's limit
        await ctx.pools.refuse_while_held(queue, model_id)
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
    held = await ctx.pools.assigned_adapters(queues)
    return min(zip(held, range(len(queues)), queues, strict=True))[2]


async def forward_backward(ctx: ApiContext, tenant: str, policy: TenantPolicy, model_id: str,
                           batch: ForwardBackwardInput, *, seq_id: int | None, forward_only: bool,
                           provenance: Sequence[tuple[Span, ...] | None]) -> tuple[ModelRecord, str]:
    """A forward (or forward_backward) of a decoded batch: its loss, its provenance (stable_reinforce) and its
    lengths checked against the model before it is submitted."""
    record = await ctx.store.model_to_submit(model_id, tenant)
    validate_loss(batch.loss_fn, batch.data, batch.loss_fn_config)
    if batch.loss_fn == "stable_reinforce":
        await check_provenance(ctx.stability, tenant, batch.data, provenance or (None,) * len(batch.data))
    await _check_lengths(ctx, record, batch)
    tokens = sum(input_length(d.model_input) for d in batch.data)
    op = Op.FORWARD if forward_only else Op.FORWARD_BACKWARD
    return record, await submit_op(ctx, tenant, policy, record, op, batch, seq_id=seq_id, input_tokens=tokens,
                                   check_model=True)


async def _check_lengths(ctx: ApiContext, record: ModelRecord, batch: ForwardBackwardInput) -> None:
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


def check_same_mode(run_mode: str, checkpoint_mode: str, path: str) -> None:
    """A LoRA run loads LoRA checkpoints and a full run full ones: never one silently as the other."""
    if run_mode != checkpoint_mode:
        raise InvalidRequest(f"{path} is a {checkpoint_mode} checkpoint; this run trains in {run_mode} mode.",
                             hint=f"Create a {checkpoint_mode} run from it: load_weights with session_id, no model_id.")


async def load_weights(ctx: ApiContext, tenant: str, policy: TenantPolicy, path: str, *, model_id: str | None,
                       optimizer: bool, seq_id: int | None, session_id: str | None, model_seq_id: int | None,
                       base_model: str | None, user_metadata: dict[str, Any] | None) -> tuple[ModelRecord, str]:
    """Load a checkpoint into the caller's model `model_id`, or into a new model of session `session_id`
    built as the checkpoint's run was."""
    ref = parse_checkpoint_path(path)
    metadata = ctx.checkpoints.metadata(tenant, ref)
    if model_id:
        record = await ctx.store.model(model_id, tenant)
        check_same_mode(record.lora.get("mode", "lora"), (metadata.get("lora") or {}).get("mode", "lora"), path)
        req = LoadRequest(owner=tenant, path=path, include_optimizer=optimizer)
        return record, await submit_op(ctx, tenant, policy, record, Op.LOAD_STATE, req, seq_id=seq_id)
    if not session_id:
        raise InvalidRequest("load_weights needs model_id, or session_id to create a model from the checkpoint.")
    lora = metadata.get("lora") or {}
    spec = lora_spec_from_dict(lora)
    record = await register_model(ctx, tenant, policy, Op.LOAD_STATE, session_id, model_seq_id,
                                  base_model or metadata.get("base_model") or "", spec, user_metadata)
    req = LoadRequest(owner=tenant, path=path, include_optimizer=optimizer, lora=spec)
    rid = await ctx.store.submit(op=Op.LOAD_STATE, owner=tenant, model_id=record.model_id, queue=record.queue,
                                 payload=req, seq_id=0, weight=policy.weight)
    return record, rid


async def unload_model(ctx: ApiContext, tenant: str, policy: TenantPolicy, model_id: str) -> tuple[ModelRecord, str]:
    record = await ctx.store.model(model_id, tenant)
    await ctx.limiter.admit(tenant, record.queue)  # no quota refuses an unload: it frees what the key holds
    rid = await ctx.store.submit(op=Op.UNLOAD_MODEL, owner=tenant, model_id=record.model_id,
                                 queue=record.queue, payload=None, weight=policy.weight)
    await ctx.store.release_model(record, reason="unloaded by its owner")
    return record, rid


async def unload_session_models(ctx: ApiContext, tenant: str, policy: TenantPolicy, session_id: str,
                                reason: str) -> None:
    """Unload the session's models at once, so their LoRA slots and the key's model count are free for the next
    run instead of waiting out adapter_timeout."""
    for record in await ctx.store.session_models(session_id, tenant):
        await ctx.store.submit(op=Op.UNLOAD_MODEL, owner=tenant, model_id=record.model_id, queue=record.queue,
                               payload=None, weight=policy.weight)
        await ctx.store.release_model(record, reason=f"its session finished ({reason})")
