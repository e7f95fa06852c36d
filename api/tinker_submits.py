"""The Tinker protocol's submits, read from their bodies (api/tinker_codec) and made through the training and
sampling services: what the routes (api/routes/training.py, api/routes/sampling.py) and the middleware that
answers them before the framework (api/submits.py) both do."""

from __future__ import annotations

from typing import Any

from api.context import ApiContext
from api.schemas import OptimStepBody, SampleBody
from api.services import sampling, training
from api.tinker_codec import (
    adam_params_from_json,
    decode_forward_backward,
    decode_model_input,
    sampling_params_from_json,
)
from twinkle.errors import InvalidRequest
from twinkle.futures import Op
from twinkle.records import ModelRecord
from twinkle.tenancy import TenantPolicy
from twinkle.types import SampleRequest, input_length


async def forward_backward(ctx: ApiContext, tenant: str, policy: TenantPolicy, body: bytes, content_type: str,
                           content_encoding: str | None, *, forward_only: bool) -> tuple[ModelRecord, str]:
    """A forward_backward (or forward) request body as the Tinker SDK sends it: protobuf or JSON, maybe zstd."""
    meta, batch, _is_proto = decode_forward_backward(body, content_type, content_encoding,
                                                     max_bytes=ctx.max_request_bytes, vocab_size=None)
    return await training.forward_backward(ctx, tenant, policy, meta.model_id, batch, seq_id=meta.seq_id,
                                           forward_only=forward_only or meta.forward_only, provenance=meta.provenance)


async def optim_step(ctx: ApiContext, tenant: str, policy: TenantPolicy,
                     body: OptimStepBody) -> tuple[ModelRecord, str]:
    if body.adam_params is None:
        raise InvalidRequest("optim_step needs adam_params.", hint="Only the Adam optimizer is supported.")
    record = await ctx.store.model_to_submit(body.model_id, tenant)
    params = adam_params_from_json(body.adam_params.model_dump())
    return record, await training.submit_op(ctx, tenant, policy, record, Op.OPTIM_STEP, params, seq_id=body.seq_id,
                                            check_model=True)


async def asample(ctx: ApiContext, tenant: str, policy: TenantPolicy, body: SampleBody) -> dict[str, Any]:
    """A sample request (`POST /asample`): checked against the served model, submitted, answered with its future."""
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
