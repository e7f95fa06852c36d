"""The sampling loop shared by the transformers backend and the torch sampler.

A batch of requests, each with its own adapter, runs as one batched generation: prompts are left-padded
and prefilled once per request, the KV cache is then copied to each of its `num_samples` rows, and every step
feeds one token per unfinished row (finished rows leave the batch). Each request draws from its own
`torch.Generator`, so a seeded request gives the same tokens whatever else shares its batch. Sampled and
prompt logprobs are the raw model's (temperature 1), computed as the trainer computes them. Images in a
prompt are expanded into image tokens (`hf.images`) and read in the prefill; decoding then needs only the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.backends.hf.batching import target_logprobs
from twinkle.backends.hf.images import images_checked_by_model
from twinkle.backends.hf.shared_model import SharedModel
from twinkle.errors import InvalidRequest
from twinkle.types import SampledSequence, SampleOutput, SampleRequest, SamplingParams, StopReason

# A character can take up to 4 byte-level tokens; a stop string is searched for in this many tokens per char.
_TOKENS_PER_STOP_CHAR = 4


@dataclass
class _Row:
    """One sample being generated."""

    request: int
    limit: int  # tokens this row may still produce in total
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: StopReason | None = None


def generate(
    shared: SharedModel, requests: Sequence[SampleRequest], adapter_names: Sequence[str] | None
) -> list[SampleOutput]:
    """Complete every request; `adapter_names[i]` is request i's adapter (None: the active adapter)."""
    base = shared.base
    expanded = [base.images.prompt(request.prompt, f"request {index}") for index, request in enumerate(requests)]
    prompts = [tokens for tokens, _ in expanded]
    _check_requests(requests, prompts, vocab_size=base.info.vocab_size, max_context=base.info.max_context_length)
    if not requests:
        return []
    device = base.device
    vision = base.images.batch([arrays for _, arrays in expanded], device=device, dtype=base.model.dtype)
    shared.train(False)
    with torch.inference_mode():
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), base.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, width - len(prompt) :] = torch.from_numpy(prompt)
            attention[index, width - len(prompt) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        wants_prompt_logprobs = any(r.prompt_logprobs or r.topk_prompt_logprobs > 0 for r in requests)
        # Without prompt logprobs only the last position's logits are needed: spare the [B, T, vocab] tensor.
        last_only = {"logits_to_keep": 1} if shared.accepts_logits_to_keep and not wants_prompt_logprobs else {}
        with images_checked_by_model(bool(vision)):
            output = shared(
                adapter_names,
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
                **last_only,
                **vision,
            )
        results = [
            _prompt_output(request, output.logits[index], input_ids[index], len(prompt))
            for index, (request, prompt) in enumerate(zip(requests, prompts, strict=True))
        ]
        rows = [
            _Row(index, min(request.params.max_tokens, base.info.max_context_length - len(prompts[index])))
            for index, request in enumerate(requests)
            for _ in range(request.num_samples)
        ]
        _decode(shared, requests, adapter_names, rows, output, attention)
    for row in rows:
        sequence = SampledSequence(row.tokens, row.logprobs, row.stop_reason or "length")
        results[row.request].sequences.append(sequence)
    return results


def _decode(
    shared: SharedModel,
    requests: Sequence[SampleRequest],
    adapter_names: Sequence[str] | None,
    rows: list[_Row],
    prefill: Any,
    prompt_attention: torch.Tensor,
) -> None:
    """Run the token-by-token loop until every row stops."""
    device = shared.base.device
    generators = [_generator(request.params, device) for request in requests]
    active = [index for index, row in enumerate(rows) if row.limit > 0]
    for row in rows:
        if row.limit <= 0:
            row.stop_reason = "length"
    if not active:
        return
    # Rows of one request share its prefill; copy cache, mask and next-token logits to each row.
    origin = torch.tensor([rows[index].request for index in active], device=device)
    cache = shared.kv_cache(prefill)
    cache.reorder_cache(origin)
    logits = prefill.logits[:, -1, :].float().index_select(0, origin)
    attention = prompt_attention.index_select(0, origin)
    positions = attention.sum(-1)
    eos_ids = shared.base.eos_token_ids
    while True:
        chosen = _choose_tokens(logits, [rows[index] for index in active], requests, generators)
        chosen_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        for slot, (token, logprob) in enumerate(zip(chosen.tolist(), chosen_logprobs.tolist(), strict=True)):
            row = rows[active[slot]]
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.stop_reason = _stop_reason(row, requests[row.request].params, eos_ids, shared)
        keep = [slot for slot, index in enumerate(active) if rows[index].stop_reason is None]
        if not keep:
            return
        if len(keep) < len(active):
            kept = torch.tensor(keep, device=device)
            cache.reorder_cache(kept)
            attention, positions, chosen = attention[kept], positions[kept], chosen[kept]
            active = [active[slot] for slot in keep]
        attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=1)
        names = None if adapter_names is None else [adapter_names[rows[index].request] for index in active]
        output = shared(
            names,
            input_ids=chosen.unsqueeze(-1),
            attention_mask=attention,
            position_ids=positions.unsqueeze(-1),
            use_cache=True,
            **{shared.cache_argument: cache},
        )
        cache = shared.kv_cache(output)
        logits = output.logits[:, -1, :].float()
        positions = positions + 1


def _choose_tokens(
    logits: torch.Tensor, rows: list[_Row], requests: Sequence[SampleRequest], generators: list[torch.Generator]
) -> torch.Tensor:
    """The next token of each active row, drawn per request from that request's generator."""
    chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    by_request: dict[int, list[int]] = {}
    for slot, row in enumerate(rows):
        by_request.setdefault(row.request, []).append(slot)
    for request_index, slots in by_request.items():
        index = torch.tensor(slots, device=logits.device)
        params = requests[request_index].params
        chosen[index] = _draw(logits.index_select(0, index), params, generators[request_index])
    return chosen


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Greedy at temperature 0; otherwise sample after temperature, top-k and top-p (nucleus) filtering."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        outside = (probs.cumsum(dim=-1) - probs) >= params.top_p
        ordered = ordered.masked_fill(outside, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _stop_reason(row: _Row, params: SamplingParams, eos_ids: frozenset[int], shared: SharedModel) -> StopReason | None:
    token = row.tokens[-1]
    if (params.stop_at_eos and token in eos_ids) or token in params.stop_token_ids:
        return "stop"
    if params.stop_strings:
        window = _TOKENS_PER_STOP_CHAR * max(len(text) for text in params.stop_strings) + 1
        tail = shared.base.tokenizer.decode(row.tokens[-window:], skip_special_tokens=False)
        if any(text in tail for text in params.stop_strings):
            return "stop"
    if len(row.tokens) >= row.limit:
        return "length"
    return None


def _generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def _prompt_output(request: SampleRequest, logits: torch.Tensor, input_ids: torch.Tensor, length: int) -> SampleOutput:
    """Prompt logprobs (first position None) and top-k alternatives from the prefill logits of one prompt.

    `prompt_length` counts the tokens the model read, each image as its expanded image tokens.
    """
    output = SampleOutput(sequences=[], prompt_length=length)
    if not (request.prompt_logprobs or request.topk_prompt_logprobs > 0):
        return output
    width = logits.shape[0]
    predicting = logits[width - length : width - 1]  # position t predicts prompt token t + 1
    if request.prompt_logprobs:
        values = target_logprobs(predicting.unsqueeze(0), input_ids[width - length + 1 :].unsqueeze(0))[0]
        output.prompt_logprobs = [None, *values.tolist()]
    if request.topk_prompt_logprobs > 0:
        k = min(request.topk_prompt_logprobs, logits.shape[-1])
        top = torch.log_softmax(predicting.float(), dim=-1).topk(k, dim=-1)
        pairs = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]
        output.topk_prompt_logprobs = [[], *pairs]
    return output


def _check_requests(
    requests: Sequence[SampleRequest], prompts: Sequence[object], *, vocab_size: int, max_context: int
) -> None:
    problems = []
    for index, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
        params = request.params
        tokens = torch.as_tensor(prompt)
        if tokens.numel() == 0:
            problems.append(f"request {index} has an empty prompt")
        elif int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
            problems.append(f"request {index} has token ids outside [0, {vocab_size})")
        if tokens.numel() > max_context:
            problems.append(f"request {index} has a {tokens.numel()}-token prompt, over the context of {max_context}")
        if request.num_samples < 1:
            problems.append(f"request {index} asks for {request.num_samples} samples (at least 1)")
        if params.max_tokens < 0:
            problems.append(f"request {index} has max_tokens {params.max_tokens} (at least 0)")
        if not params.temperature >= 0:
            problems.append(f"request {index} has temperature {params.temperature} (0 for greedy, or more)")
        if not 0 < params.top_p <= 1:
            problems.append(f"request {index} has top_p {params.top_p} (in (0, 1])")
        if request.topk_prompt_logprobs < 0:
            problems.append(f"request {index} has topk_prompt_logprobs {request.topk_prompt_logprobs} (at least 0)")
    if problems:
        raise InvalidRequest("Invalid sample request: " + "; ".join(problems[:10]) + ".", problems=len(problems))
