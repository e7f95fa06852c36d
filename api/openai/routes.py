"""`/v1/chat/completions`, `/v1/completions`, `/v1/models`: OpenAI-compatible sampling for evaluation tools.

`model` is a served base model or one of the caller's checkpoint paths (`tinker://<run>/sampler_weights/<name>`);
another tenant's checkpoint is a 404 like a missing one. The API applies the model's chat template and
tokenizes (twinkle.chat_tokenizer, no torch here), then submits one sample op per prompt to the sampler pool
exactly like `/asample` (a future underneath, so continuous batching applies) and waits for it. Streaming
answers with server-sent events: the role at once, keep-alive comments while the op waits, and the text as
the sampler pool publishes its tokens (api/openai/token_feed.py); samplers that cannot stream send it whole
at the end, as per-token deltas (api/openai/streaming.py).

Logprobs (chat `logprobs` / `top_logprobs`, completions `logprobs` and `echo`) are the sampler's: the raw
model's log-softmax at temperature 1, the numbers a training `forward` computes for the same tokens. Every
request parameter is honoured or refused by name (api/openai/wire.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from api.context import ApiContext
from api.deps import Ctx, Policy, Tenant
from api.errors import request_id_of
from api.openai import wire
from api.openai.choices import Choice, choices_of
from api.openai.streaming import KEEPALIVE_SECONDS, DeltaText, sse_event, sse_response
from api.openai.token_feed import Check, TokenFeed, follow_without_feed
from api.responses.answer import described_by
from api.responses.openai import ChatCompletion, Completion, ModelList, streamed
from api.services import checkpoints, sampling
from twinkle.chat_tokenizer import ChatTokenizer, load_chat_tokenizer
from twinkle.checkpoints import SCHEMES
from twinkle.errors import InvalidRequest, NotFound, RateLimited, TwinkleError
from twinkle.futures import Op
from twinkle.tenancy import TenantPolicy
from twinkle.types import SampleOutput, SampleRequest, SamplingParams, chunks_from_tokens

DEFAULT_CHAT_MAX_TOKENS = 512  # OpenAI's "up to the context" would make a CPU model talk for minutes
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MODELS_PAGE = 100  # /v1/models entries per page unless `limit` says otherwise
MODELS_PAGE_MAX = 1000
MAX_PROMPTS = 64


class OpenAIRoute(APIRoute):
    """Errors in OpenAI's shape (`{"error": {"message", "type", "code"}}`), which OpenAI clients read."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def shaped(request: Request) -> Response:
            try:
                return await handler(request)
            except TwinkleError as exc:
                return _error(request, exc.status_code, str(exc), exc.code, exc)
            except RequestValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: "
                                     f"{e.get('msg', 'invalid')}" for e in exc.errors()[:20])
                return _error(request, 400, f"Invalid request: {problems}. Fix these fields and resend.",
                              "invalid_request")

        return shaped


def _error(request: Request, status: int, message: str, code: str, exc: TwinkleError | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    if code == "quota_exceeded":
        kind = "insufficient_quota"  # OpenAI's own type for a used-up quota
    headers = {"x-request-id": request_id_of(request)}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, round(float(exc.details.get("retry_after", 1)))))
    return JSONResponse(wire.error_body(message, kind, code), status_code=status, headers=headers)


router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)


@dataclass
class Target:
    model: str  # as the caller named it, echoed back
    queue: str
    adapter_dir: str | None
    tokenizer: ChatTokenizer
    context: int | None


async def resolve(ctx: ApiContext, tenant: str, model: str) -> Target:
    if model.startswith(SCHEMES):  # a checkpoint: NotFound unless the caller's
        name, queue, adapter_dir = await sampling.sampling_target(ctx, tenant, None, model)
    else:
        try:
            name, queue, adapter_dir = await sampling.sampling_target(ctx, tenant, model, None)
        except InvalidRequest as exc:
            raise NotFound(f"The model {model!r} does not exist here.", hint=exc.hint) from None
    served = ctx.catalog.find(name)
    info = await ctx.model_info(served) or {}
    tokenizer_dir = info.get("tokenizer_id")
    if not (tokenizer_dir and Path(tokenizer_dir).is_dir()):
        from twinkle.template.hub import model_directory

        tokenizer_dir = str(await asyncio.to_thread(model_directory, served.model_id))
    tokenizer = await asyncio.to_thread(load_chat_tokenizer, str(tokenizer_dir))
    return Target(model, queue, adapter_dir, tokenizer, served.max_length or info.get("max_context_length"))


def check_parameters(body: wire.SamplingFields) -> None:
    """400 naming every parameter Twinkle cannot honour, before anything is resolved or submitted."""
    refused = body.refused()
    if refused:
        raise InvalidRequest(f"Twinkle does not support these parameters: {'; '.join(refused)}.",
                             hint="Leave them unset (or null), or change them as said.")


def _params(body: wire.SamplingFields, max_tokens: int, tokenizer: ChatTokenizer) -> SamplingParams:
    stop_ids = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None
                          else body.temperature, top_p=body.top_p or 1.0,
                          top_k=-1 if body.top_k in (None, 0) else int(body.top_k), seed=body.seed,
                          stop_token_ids=stop_ids, stop_strings=body.stop_strings())


@dataclass(frozen=True)
class Logprobs:
    """What logprobs a sample op returns: the prompt's (with their top-k) and the sampled tokens' top-k."""

    prompt: bool = False
    prompt_top: int = 0
    sampled_top: int = 0


async def submit(ctx: ApiContext, tenant: str, policy: TenantPolicy, target: Target, prompt: list[int],
                 params: SamplingParams, n: int, *, logprobs: Logprobs = Logprobs(),
                 feed: TokenFeed | None = None) -> str:
    """One sample op, like `/asample`'s; the caller checked the key's quotas once for all its prompts."""
    sampling.check_context(len(prompt), params.max_tokens, target.context)
    req = SampleRequest(prompt=chunks_from_tokens(prompt), params=params, num_samples=n,
                        prompt_logprobs=logprobs.prompt, topk_prompt_logprobs=logprobs.prompt_top,
                        topk_sample_logprobs=logprobs.sampled_top,
                        adapter_path=target.adapter_dir, stream_channel=feed.channel if feed else None)
    return await sampling.submit_sample(ctx, tenant, policy, target.queue, req, input_tokens=len(prompt))


def _check(ctx: ApiContext, tenant: str, request_id: str) -> Check:
    async def check(timeout: float) -> SampleOutput | None:
        return await sampling.sample_output(ctx, tenant, request_id, timeout=timeout)

    return check


# -- chat ----------------------------------------------------------------------------------------------------


@router.post("/chat/completions", response_model=None, responses=streamed(ChatCompletion, "ChatCompletionChunk"))
async def chat_completions(body: wire.ChatCompletionBody, ctx: Ctx, tenant: Tenant,
                           policy: Policy) -> Response | dict[str, Any]:
    check_parameters(body)
    target = await resolve(ctx, tenant, body.model)
    await ctx.quotas.check(tenant, policy, Op.SAMPLE)
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages]
    prompt_text = target.tokenizer.render(messages, add_generation_prompt=True)
    prompt = target.tokenizer.encode(prompt_text, add_special_tokens=False)
    params = _params(body, body.max_new_tokens(DEFAULT_CHAT_MAX_TOKENS), target.tokenizer)
    if body.stream:
        feed = await TokenFeed.open(ctx)
        try:
            request_id = await submit(ctx, tenant, policy, target, prompt, params, body.n, feed=feed)
        except BaseException:
            await feed.close()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_stream(ctx, tenant, request_id, feed, target, body, len(prompt), include_usage))
    request_id = await submit(ctx, tenant, policy, target, prompt, params, body.n,
                              logprobs=Logprobs(sampled_top=(body.top_logprobs or 0) if body.logprobs else 0))
    ident = f"chatcmpl-{request_id}"
    out = await sampling.sample_output(ctx, tenant, request_id)
    assert out is not None
    choices = choices_of(out, target.tokenizer, params.stop_strings)
    return wire.envelope("chat.completion", ident, body.model, [
        {"index": i, "message": {"role": "assistant", "content": c.text},
         "logprobs": _chat_logprobs(c, target.tokenizer) if body.logprobs else None, "finish_reason": c.finish_reason}
        for i, c in enumerate(choices)], usage=wire.usage(len(prompt), sum(len(c.tokens) for c in choices)))


def _chat_logprobs(choice: Choice, tokenizer: ChatTokenizer) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.token_text(token), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token))}

    tops = choice.top or [[] for _ in choice.tokens]
    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                        for token, logprob, top in zip(choice.tokens, choice.logprobs, tops, strict=False)]}


async def _chat_stream(ctx: ApiContext, tenant: str, request_id: str, feed: TokenFeed, target: Target,
                       body: wire.ChatCompletionBody, prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    ident = f"chatcmpl-{request_id}"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse_event(wire.envelope("chat.completion.chunk", ident, body.model, choices, **extra))

    def content(index: int, piece: str) -> str:
        return chunk([{"index": index, "delta": {"content": piece}, "finish_reason": None}])

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                 for i in range(body.n)])
    texts = [DeltaText(target.tokenizer, body.stop_strings()) for _ in range(body.n)]
    async for item in feed.follow(request_id, _check(ctx, tenant, request_id), KEEPALIVE_SECONDS):
        if item is None:
            yield ": keep-alive\n\n"
        elif isinstance(item, list):  # tokens as the sampler generates them
            for i, tokens in enumerate(item[: body.n]):
                if piece := texts[i].grow(tokens):
                    yield content(i, piece)
        else:
            choices = choices_of(item, target.tokenizer, body.stop_strings())
            for i, c in enumerate(choices):
                for piece in texts[i].finish(c):
                    yield content(i, piece)
                yield chunk([{"index": i, "delta": {}, "finish_reason": c.finish_reason}])
            if include_usage:
                yield chunk([], usage=wire.usage(prompt_tokens, sum(len(c.tokens) for c in choices)))
    yield "data: [DONE]\n\n"


# -- completions ---------------------------------------------------------------------------------------------


def _prompts(body: wire.CompletionBody, tokenizer: ChatTokenizer) -> list[list[int]]:
    raw = body.prompt
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [raw]
    else:
        items = list(raw)
    if len(items) > MAX_PROMPTS:
        raise InvalidRequest(f"At most {MAX_PROMPTS} prompts per request, got {len(items)}.",
                             hint="Send them in several requests.")
    prompts = [tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else [int(t) for t in p]
               for p in items]
    if any(not p for p in prompts):
        raise InvalidRequest("A prompt is empty.", hint="Send at least one token of prompt.")
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise InvalidRequest(f"A prompt holds a token id outside the vocabulary (0..{vocab - 1}).",
                             hint="Tokenize with the model's own tokenizer.")
    return prompts


@router.post("/completions", response_model=None, responses=streamed(Completion, "Completion"))
async def completions(body: wire.CompletionBody, ctx: Ctx, tenant: Tenant,
                      policy: Policy) -> Response | dict[str, Any]:
    check_parameters(body)
    target = await resolve(ctx, tenant, body.model)
    await ctx.quotas.check(tenant, policy, Op.SAMPLE)
    prompts = _prompts(body, target.tokenizer)
    requested = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = _params(body, requested, target.tokenizer)
    # echo + logprobs is how evaluation harnesses score a text: the prompt's own logprobs (and top-k for greedy)
    scoring = body.echo and body.logprobs is not None
    wanted = Logprobs(prompt=scoring, prompt_top=(body.logprobs or 0) if scoring else 0,
                      sampled_top=body.logprobs or 0)
    # one prompt streams its tokens as they come; several arrive each whole (one subscription per answer)
    feed = await TokenFeed.open(ctx) if body.stream and len(prompts) == 1 else None
    try:
        ids = [await submit(ctx, tenant, policy, target, p, params, body.samples(), logprobs=wanted, feed=feed)
               for p in prompts]
    except BaseException:
        if feed is not None:
            await feed.close()
        raise
    ident = f"cmpl-{ids[0]}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_completion_stream(ctx, tenant, ids, feed, ident, target, body, prompts, requested,
                                       include_usage))
    outs = await asyncio.gather(*(sampling.sample_output(ctx, tenant, rid) for rid in ids))
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out is not None
        generated = choices_of(out, target.tokenizer, params.stop_strings, keep_tokens=requested > 0)
        completion_tokens += sum(len(c.tokens) for c in generated)  # best_of: every generated token counts
        if body.samples() > body.n:  # best_of: the n with the highest log probability per token, best first
            generated = sorted(generated, key=lambda c: c.mean_logprob(), reverse=True)[: body.n]
        for c in generated:
            text = (target.tokenizer.decode(prompt) if body.echo else "") + c.text
            logprobs = (_completion_logprobs(c, prompt, out, target.tokenizer, body)
                        if body.logprobs is not None else None)
            choices.append({"index": len(choices), "text": text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason if requested > 0 else "length"})
    return wire.envelope("text_completion", ident, body.model, choices,
                         usage=wire.usage(sum(len(p) for p in prompts), completion_tokens))


def _completion_logprobs(choice: Choice, prompt: list[int], out: SampleOutput, tokenizer: ChatTokenizer,
                         body: wire.CompletionBody) -> dict[str, Any]:
    """OpenAI's legacy logprobs: per token its text, logprob and a {text: logprob} of the `logprobs` most likely
    tokens plus the token itself (so up to logprobs + 1 entries, as OpenAI and vLLM return them)."""
    def alternatives(token: int, logprob: float, top: Sequence[tuple[int, float]]) -> dict[str, float]:
        listed = {tokenizer.token_key(t): lp for t, lp in top}
        listed.setdefault(tokenizer.token_key(token), logprob)
        return listed

    tokens: list[int] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if body.echo:
        tokens += prompt
        prompt_logprobs = list(out.prompt_logprobs or [None] * len(prompt))[: len(prompt)]
        prompt_tops = list(out.topk_prompt_logprobs or [])[: len(prompt)]
        prompt_tops += [[]] * (len(prompt) - len(prompt_tops))
        logprobs += prompt_logprobs
        tops += [None if lp is None else alternatives(token, lp, top)
                 for token, lp, top in zip(prompt, prompt_logprobs, prompt_tops, strict=True)]
    tokens += choice.tokens
    logprobs += choice.logprobs
    sampled_tops = choice.top or [[] for _ in choice.tokens]
    tops += [alternatives(t, lp, top) for t, lp, top in zip(choice.tokens, choice.logprobs, sampled_tops,
                                                            strict=False)]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(tokenizer.token_text(token))
    return {"tokens": [tokenizer.token_key(t) for t in tokens], "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}


async def _completion_stream(ctx: ApiContext, tenant: str, ids: list[str], feed: TokenFeed | None, ident: str,
                             target: Target, body: wire.CompletionBody, prompts: list[list[int]], requested: int,
                             include_usage: bool) -> AsyncIterator[str]:
    def chunk(index: int, text: str, finish_reason: str | None = None) -> str:
        return sse_event(wire.envelope("text_completion", ident, body.model, [
            {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]))

    first, completion_tokens = 0, 0
    for prompt, request_id in zip(prompts, ids, strict=True):
        check = _check(ctx, tenant, request_id)
        items = feed.follow(request_id, check, KEEPALIVE_SECONDS) if feed else follow_without_feed(
            check, KEEPALIVE_SECONDS)
        texts = [DeltaText(target.tokenizer, body.stop_strings(), keep=requested > 0) for _ in range(body.n)]
        if body.echo:
            for i in range(body.n):
                yield chunk(first + i, target.tokenizer.decode(prompt))
        async for item in items:
            if item is None:
                yield ": keep-alive\n\n"
            elif isinstance(item, list):
                for i, tokens in enumerate(item[: body.n]):
                    if piece := texts[i].grow(tokens):
                        yield chunk(first + i, piece)
            else:
                choices = choices_of(item, target.tokenizer, body.stop_strings(), keep_tokens=requested > 0)
                for i, c in enumerate(choices):
                    completion_tokens += len(c.tokens)
                    for piece in texts[i].finish(c):
                        yield chunk(first + i, piece)
                    yield chunk(first + i, "", c.finish_reason if requested > 0 else "length")
        first += body.n
    if include_usage:
        yield sse_event(wire.envelope("text_completion", ident, body.model, [],
                                   usage=wire.usage(sum(len(p) for p in prompts), completion_tokens)))
    yield "data: [DONE]\n\n"


# -- models --------------------------------------------------------------------------------------------------


@router.get("/models", response_model=described_by(ModelList))
async def models(request: Request, ctx: Ctx, tenant: Tenant,
                 limit: int = Query(default=MODELS_PAGE, ge=1, le=MODELS_PAGE_MAX),
                 after: str | None = Query(default=None, max_length=1000),
                 run: str | None = Query(default=None, max_length=200)) -> dict[str, Any]:
    """Served base models (by name), then the caller's own sampler checkpoints, newest first (each usable as
    `model`), `limit` at a time. `after` is the last id of the previous page (`last_id`), `has_more` says
    whether another page follows; `run` keeps only that training run's checkpoints (and no base models)."""
    unknown = sorted(set(request.query_params) - {"limit", "after", "run"})
    if unknown:
        raise InvalidRequest(f"/v1/models does not take {', '.join(unknown)}.", hint="It takes limit, after and run.")
    data = [] if run is not None else [wire.model_entry(name, "twinkle") for name in sorted(ctx.catalog.models)]
    data += [wire.model_entry(path, tenant, created)
             for created, path in await checkpoints.sampler_paths(ctx, tenant, run)]  # 404 unless the caller's run
    start = 0
    if after is not None:
        start = next((index + 1 for index, model in enumerate(data) if model["id"] == after), -1)
        if start < 0:
            raise InvalidRequest(f"after={after!r} names no model in this list.",
                                 hint="Pass the last_id of the previous page.")
    page = data[start : start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(data)}
