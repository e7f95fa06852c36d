"""Sampling for the Tinker routes and the OpenAI endpoint alike: where a sample op goes (a sampling session, a
base model or a checkpoint), submitting it, and its output."""

from __future__ import annotations

import time

from api.context import ApiContext
from api.schemas import checked_new_id
from api.services.futures import wait_for_future
from twinkle.checkpoints import parse_checkpoint_path
from twinkle.errors import BackendFailure, InvalidRequest
from twinkle.futures import FutureStatus, Op
from twinkle.records import SamplingSessionRecord
from twinkle.tenancy import TenantPolicy
from twinkle.types import SampleOutput, SampleRequest


async def sampling_target(ctx: ApiContext, tenant: str, base_model: str | None, model_path: str | None
                  ) -> tuple[str, str, str | None]:
    """(served model name, queue, adapter directory) for sampling a base model or a checkpoint."""
    adapter_dir = None
    if model_path:
        ref = parse_checkpoint_path(model_path)
        adapter_dir = str(ctx.checkpoints.existing(tenant, ref))
        base_model = base_model or ctx.checkpoints.metadata(tenant, ref).get("base_model")
    if not base_model:
        raise InvalidRequest("Sampling needs base_model or model_path.",
                             hint="Pass the base model name, or a tinker:// sampler checkpoint path.")
    served = ctx.catalog.find(base_model)
    queue = served.sample_queue()
    if queue is None:
        raise InvalidRequest(f"No pool samples {served.name}.", hint="Configure a sampler or model application.")
    return served.name, queue, adapter_dir


async def request_target(ctx: ApiContext, tenant: str, sampling_session_id: str | None, base_model: str | None,
                         model_path: str | None) -> tuple[str, str, str | None, str]:
    """`sampling_target` of a sample request, and the scope its seq_id dedupes in ("" = none): its sampling
    session's, or the base model or checkpoint it names itself."""
    if sampling_session_id:
        session = await ctx.store.sampling_session(sampling_session_id, tenant)
        name, queue, adapter_dir = await sampling_target(ctx, tenant, session.base_model, session.model_path or None)
        return name, queue, adapter_dir, session.sampling_session_id
    name, queue, adapter_dir = await sampling_target(ctx, tenant, base_model, model_path)
    return name, queue, adapter_dir, ""


async def create_sampling_session(ctx: ApiContext, tenant: str, session_id: str, base_model: str | None,
                                  model_path: str | None, seq: int | None) -> SamplingSessionRecord:
    """A sampling session of the caller's session; its id is the session's and `seq` (by default the time in ms)."""
    await ctx.store.session(session_id, tenant)
    name, queue, _ = await sampling_target(ctx, tenant, base_model, model_path)
    seq = seq if seq is not None else int(time.time() * 1000)
    sampling_session_id = checked_new_id(f"{session_id}:sample:{seq}", "sampling session id")
    record = SamplingSessionRecord(sampling_session_id=sampling_session_id, owner=tenant, session_id=session_id,
                                   base_model=name, queue=queue, model_path=model_path or "", created_at=time.time())
    await ctx.store.add_sampling_session(record)
    return record


def check_context(prompt_tokens: int, max_tokens: int, context: int | None) -> None:
    """The prompt and the tokens to sample must fit the model's context."""
    if context and prompt_tokens + max_tokens > context:
        raise InvalidRequest(f"The prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"model's context of {context} tokens.", hint="Shorten the prompt or lower max_tokens.")


async def submit_sample(ctx: ApiContext, tenant: str, policy: TenantPolicy, queue: str, req: SampleRequest, *,
                        input_tokens: int, seq_id: int | None = None, dedupe_scope: str = "",
                        record_stability: bool = False) -> str:
    """One sample op on `queue`, counted against the key's rate limits there (its quotas are the caller's to
    check, once per request). `record_stability` keeps its sequences trainable by stable_reinforce for a day."""
    await ctx.limiter.admit(tenant, queue, input_tokens=input_tokens)
    request_id = await ctx.store.submit(op=Op.SAMPLE, owner=tenant, model_id="", queue=queue, payload=req,
                                        seq_id=seq_id, dedupe_scope=dedupe_scope, weight=policy.weight)
    if record_stability:
        await ctx.stability.record(request_id, tenant, input_tokens, req.num_samples)
    return request_id


async def sample_output(ctx: ApiContext, tenant: str, request_id: str, *,
                        timeout: float | None = None) -> SampleOutput | None:
    """The sample op's output once it finished (None when `timeout` passed first); a failed op raises its error."""
    record = await ctx.store.future(request_id, tenant)
    while not record.state.terminal:
        record = await wait_for_future(ctx, record, tenant, ctx.long_poll_seconds if timeout is None else timeout)
        if timeout is not None and not record.state.terminal:
            return None
    if record.state is FutureStatus.FAILED:
        raise (InvalidRequest if record.category == "user" else BackendFailure)(record.error or "Sampling failed.")
    result: SampleOutput = await ctx.store.result(request_id)
    return result
