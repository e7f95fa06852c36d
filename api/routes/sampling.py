"""Sampling routes (docs/tinker_protocol.md#sampling)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from api.deps import Ctx, Policy, Tenant
from api.provenance import record_sample
from api.schemas import CreateSamplingSessionBody, SampleBody, checked_new_id
from api.services.sampling import sampling_target
from api.tinker_codec import decode_model_input, sampling_params_from_json
from twinkle.errors import InvalidRequest
from twinkle.futures import Op
from twinkle.records import SamplingSessionRecord
from twinkle.types import SampleRequest, input_length

router = APIRouter()


@router.post("/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSessionBody, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await ctx.store.session(body.session_id, tenant)
    name, queue, _ = await sampling_target(ctx, tenant, body.base_model, body.model_path)
    seq = body.sampling_session_seq_id if body.sampling_session_seq_id is not None else int(time.time() * 1000)
    sampling_session_id = checked_new_id(f"{body.session_id}:sample:{seq}", "sampling session id")
    record = SamplingSessionRecord(sampling_session_id=sampling_session_id, owner=tenant,
                                   session_id=body.session_id, base_model=name, queue=queue,
                                   model_path=body.model_path or "", created_at=time.time())
    await ctx.store.add_sampling_session(record)
    return {"type": "create_sampling_session", "sampling_session_id": record.sampling_session_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    record = await ctx.store.sampling_session(sampler_id, tenant)
    return {"sampler_id": record.sampling_session_id, "base_model": record.base_model,
            "model_path": record.model_path or None}


@router.post("/asample")
async def asample(body: SampleBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    dedupe_scope = ""
    if body.sampling_session_id:
        session = await ctx.store.sampling_session(body.sampling_session_id, tenant)
        name, queue, adapter_dir = await sampling_target(ctx, tenant, session.base_model, session.model_path or None)
        dedupe_scope = session.sampling_session_id
    else:
        name, queue, adapter_dir = await sampling_target(ctx, tenant, body.base_model, body.model_path)
    served = ctx.catalog.find(name)
    info = await ctx.model_info(served) or {}
    vocab = info.get("vocab_size")
    prompt = decode_model_input(body.prompt, where="prompt", vocab_size=vocab)
    params = sampling_params_from_json(body.sampling_params, vocab_size=vocab)
    limit = served.max_length or info.get("max_context_length")
    if limit and input_length(prompt) + params.max_tokens > limit:
        raise InvalidRequest(f"The prompt ({input_length(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds the model's context of {limit} tokens.", hint="Shorten the prompt or "
                             "lower max_tokens.")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (body.prompt_logprobs or body.topk_prompt_logprobs > 0):
        raise InvalidRequest("prompt_logprobs_last_n needs prompt_logprobs (or topk_prompt_logprobs).")
    if last_n is not None and not 1 <= last_n <= input_length(prompt) - 1:
        raise InvalidRequest(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 "
                             f"({input_length(prompt) - 1}), got {last_n}.")
    req = SampleRequest(prompt=prompt, params=params, num_samples=body.num_samples,
                        prompt_logprobs=bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0,
                        topk_prompt_logprobs=body.topk_prompt_logprobs,
                        topk_sample_logprobs=body.topk_sample_logprobs, prompt_logprobs_last_n=last_n,
                        adapter_path=adapter_dir)
    await ctx.quotas.check(tenant, policy, Op.SAMPLE)
    await ctx.limiter.admit(tenant, queue, input_tokens=input_length(prompt))
    rid = await ctx.store.submit(op=Op.SAMPLE, owner=tenant, model_id="", queue=queue, payload=req,
                                 seq_id=body.seq_id if dedupe_scope else None, dedupe_scope=dedupe_scope,
                                 weight=policy.weight)
    if body.record_stability_info:
        await record_sample(ctx.store.r, ctx.keys, rid, tenant, input_length(prompt), body.num_samples)
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(body.num_samples)]}
