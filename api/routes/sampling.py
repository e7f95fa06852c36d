"""Sampling routes (docs/tinker_protocol.md#sampling)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import Ctx, Policy, Tenant
from api.responses.answer import described_by
from api.responses.tinker import SampleFuture, SamplerInfo, SamplingSessionCreated
from api.schemas import CreateSamplingSessionBody, SampleBody
from api.services import sampling
from api.tinker_codec import decode_model_input, sampling_params_from_json
from twinkle.errors import InvalidRequest
from twinkle.futures import Op
from twinkle.types import SampleRequest, input_length

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
    name, queue, adapter_dir, dedupe_scope = await sampling.request_target(
        ctx, tenant, body.sampling_session_id, body.base_model, body.model_path)
    served = ctx.catalog.find(name)
    info = await ctx.model_info(served) or {}
    vocab = info.get("vocab_size")
    prompt = decode_model_input(body.prompt, where="prompt", vocab_size=vocab)
    params = sampling_params_from_json(body.sampling_params, vocab_size=vocab)
    sampling.check_context(input_length(prompt), params.max_tokens, served.max_length or info.get("max_context_length"))
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
    rid = await sampling.submit_sample(ctx, tenant, policy, queue, req, input_tokens=input_length(prompt),
                                       seq_id=body.seq_id if dedupe_scope else None, dedupe_scope=dedupe_scope,
                                       record_stability=body.record_stability_info)
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(body.num_samples)]}
