"""The sampling loop shared by the transformers backend and the torch sampler.

A batch of requests, each with its own adapter, runs as one batched generation: prompts are left-padded
and prefilled once per request, the KV cache is then copied to each of its `num_samples` rows, and every step
feeds one token per unfinished row (finished rows leave the batch). Each request draws from its own
`torch.Generator`, so a seeded request gives the same tokens whatever else shares its batch. Sampled and
prompt logprobs, and their top-k alternatives, are the raw model's (log-softmax of the logits at temperature 1,
before top-k / top-p filtering), computed as the trainer computes them (`batching.target_logprobs`): they
equal `forward`'s logprobs for the same tokens on the same weights, in float32 to about 1e-6 whatever the
batch, its padding or the joins. Images in a prompt are expanded into image tokens (`hf.images`) and read in
the prefill; decoding then needs only the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.backends.hf.batching import target_logprobs, top_logprobs
from twinkle.backends.hf.images import images_checked_by_model
from twinkle.backends.hf.shared_model import SharedModel
from twinkle.errors import InvalidRequest
from twinkle.types import (
    SampledSequence,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    StopReason,
    keep_last_prompt_positions,
)

# A character can take up to 4 byte-level tokens; a stop string is searched for in this many tokens per char.
_TOKENS_PER_STOP_CHAR = 4


@dataclass
class _Row:
    """One sample being generated."""

    request: int
    limit: int  # tokens this row may still produce in total
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]]] = field(default_factory=list)  # when the request asked for it
    stop_reason: StopReason | None = None


def generate(
    shared: SharedModel, requests: Sequence[SampleRequest], adapter_names: Sequence[str] | None
) -> list[SampleOutput]:
    """Complete every request; `adapter_names[i]` is request i's adapter (None: the active adapter)."""
    decoder = Decoder(shared)
    indices = decoder.add(requests, adapter_names)
    while decoder.rows_running:
        decoder.step()
    return [decoder.pop(index) for index in indices]


class Decoder:
    """A batched generation that requests can join between steps (continuous batching).

    `add` prefills new requests and merges their KV cache into the running one (both left-padded to the
    longer), `step` feeds one token to every unfinished row, `take_finished` names the requests that have
    finished since it was last asked, and `pop` hands over their outputs. A cache that is not a plain
    per-layer key/value cache (sliding or linear-attention layers) cannot be merged: `can_join` is then
    False while rows are running.
    """

    def __init__(self, shared: SharedModel) -> None:
        self.shared = shared
        # by request index, until the request is popped or failed: a long-running serve forgets what it served
        self.requests: dict[int, SampleRequest] = {}
        self.names: dict[int, str | None] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.results: dict[int, SampleOutput] = {}
        self.rows: dict[int, _Row] = {}
        self._request_ids = itertools.count()
        self._keys = itertools.count()
        self.unfinished: dict[int, int] = {}  # request index -> rows still generating
        self.active: list[int] = []  # keys of running rows, in cache order
        self.finished: list[int] = []  # requests finished since the last step
        self.cache: Any = None
        self.attention = torch.zeros((0, 0), dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)
        self.logits: torch.Tensor | None = None

    @property
    def rows_running(self) -> int:
        return len(self.active)

    @property
    def can_join(self) -> bool:
        return not self.active or _mergeable(self.cache)

    def add(self, requests: Sequence[SampleRequest], adapter_names: Sequence[str | None] | None) -> list[int]:
        """Prefill `requests` and make them part of the batch; returns their request indices.

        Raises InvalidRequest (nothing joined) for a request the model cannot serve."""
        if not self.can_join:
            raise RuntimeError("this model's KV cache cannot take new rows while others are generating")
        shared, base = self.shared, self.shared.base
        expanded = [base.images.prompt(request.prompt, f"request {index}") for index, request in enumerate(requests)]
        prompts = [tokens for tokens, _ in expanded]
        _check_requests(requests, prompts, vocab_size=base.info.vocab_size, max_context=base.info.max_context_length)
        if not requests:
            return []
        device = base.device
        vision = base.images.batch([arrays for _, arrays in expanded], device=device, dtype=base.model.dtype)
        names = list(adapter_names) if adapter_names is not None else [None] * len(requests)
        ids = [next(self._request_ids) for _ in requests]
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
                    _row_names(names),
                    input_ids=input_ids,
                    attention_mask=attention,
                    position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True,
                    **last_only,
                    **vision,
                )
            joining: list[int] = []  # prefill row of each joining sample row
            for offset, (request_id, request, name, prompt) in enumerate(zip(ids, requests, names, prompts,
                                                                             strict=True)):
                self.results[request_id] = _prompt_output(request, output.logits[offset], input_ids[offset],
                                                          len(prompt))
                self.requests[request_id] = request
                self.names[request_id] = name
                self.generators[request_id] = _generator(request.params, device)
                limit = min(request.params.max_tokens, base.info.max_context_length - len(prompt))
                rows = [_Row(request_id, limit) for _ in range(request.num_samples)]
                for row in rows:
                    key = next(self._keys)
                    self.rows[key] = row
                    if row.limit <= 0:
                        row.stop_reason = "length"
                    else:
                        self.active.append(key)
                        joining.append(offset)
                running = sum(row.stop_reason is None for row in rows)
                if running:
                    self.unfinished[request_id] = running
                else:
                    self.finished.append(request_id)
            if joining:
                # Rows of one request share its prefill; copy cache, mask and next-token logits to each row.
                origin = torch.tensor(joining, device=device)
                cache = shared.kv_cache(output)
                cache.reorder_cache(origin)
                self._merge(cache, attention.index_select(0, origin),
                            output.logits[:, -1, :].float().index_select(0, origin))
        return ids

    def _merge(self, cache: Any, attention: torch.Tensor, logits: torch.Tensor) -> None:
        if self.cache is None or self.logits is None:
            self.cache, self.attention, self.logits = cache, attention, logits
            self.positions = attention.sum(-1)
            return
        width = max(self.attention.shape[1], attention.shape[1])
        _left_pad_cache(self.cache, width - self.attention.shape[1])
        _left_pad_cache(cache, width - attention.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([old.keys, new.keys])
            old.values = torch.cat([old.values, new.values])
        self.attention = torch.cat([_left_pad(self.attention, width), _left_pad(attention, width)])
        self.positions = torch.cat([self.positions, attention.sum(-1)])
        self.logits = torch.cat([self.logits, logits])

    def running_adapters(self) -> set[str | None]:
        return {self.names[self.rows[key].request] for key in self.active}

    def take_finished(self) -> list[int]:
        finished, self.finished = self.finished, []
        return finished

    def step(self) -> None:
        """One token for every running row."""
        if not self.active or self.logits is None:
            return
        shared, device = self.shared, self.shared.base.device
        eos_ids = shared.base.eos_token_ids
        with torch.inference_mode():
            rows = [self.rows[index] for index in self.active]
            chosen = _choose_tokens(self.logits, rows, self.requests, self.generators)
            chosen_logprobs = target_logprobs(self.logits, chosen)
            alternatives = self._alternatives(rows)
            for row, token, logprob, top in zip(rows, chosen.tolist(), chosen_logprobs.tolist(), alternatives,
                                                strict=True):
                row.tokens.append(token)
                row.logprobs.append(logprob)
                if top is not None:
                    row.topk.append(top)
                row.stop_reason = _stop_reason(row, self.requests[row.request].params, eos_ids, shared)
                if row.stop_reason is not None:
                    self.unfinished[row.request] -= 1
                    if not self.unfinished[row.request]:
                        del self.unfinished[row.request]
                        self.finished.append(row.request)
            keep = [slot for slot, row in enumerate(rows) if row.stop_reason is None]
            if not keep:
                self._reset()
                return
            if len(keep) < len(self.active):
                kept = torch.tensor(keep, device=device)
                self.cache.reorder_cache(kept)
                self.attention, self.positions, chosen = self.attention[kept], self.positions[kept], chosen[kept]
                self.active = [self.active[slot] for slot in keep]
            self.attention = torch.cat([self.attention, self.attention.new_ones((len(self.active), 1))], dim=1)
            names = _row_names([self.names[self.rows[index].request] for index in self.active])
            output = shared(
                names,
                input_ids=chosen.unsqueeze(-1),
                attention_mask=self.attention,
                position_ids=self.positions.unsqueeze(-1),
                use_cache=True,
                **{shared.cache_argument: self.cache},
            )
            self.cache = shared.kv_cache(output)
            self.logits = output.logits[:, -1, :].float()
            self.positions = self.positions + 1

    def _alternatives(self, rows: list[_Row]) -> list[list[tuple[int, float]] | None]:
        """Each row's top-k (token, logprob) at this step, for rows whose request asked for them."""
        wanted = [self.requests[row.request].topk_sample_logprobs for row in rows]
        if not any(k > 0 for k in wanted):
            return [None] * len(rows)
        assert self.logits is not None
        ids, values = top_logprobs(self.logits, max(wanted))
        return [list(zip(row_ids[:k], row_values[:k], strict=True)) if k > 0 else None
                for k, row_ids, row_values in zip(wanted, ids.tolist(), values.tolist(), strict=True)]

    def partial(self, request: int) -> list[list[int]]:
        """The tokens each sample of a running request has produced so far (for streaming)."""
        return [row.tokens for _, row in sorted(self.rows.items()) if row.request == request]

    def pop(self, request: int) -> SampleOutput:
        """The finished request's output; the request and its rows are forgotten."""
        output = self.results.pop(request)
        wants_topk = self.requests[request].topk_sample_logprobs > 0
        self._forget(request)
        for key in [key for key, row in self.rows.items() if row.request == request]:
            row = self.rows.pop(key)
            output.sequences.append(SampledSequence(row.tokens, row.logprobs, row.stop_reason or "length",
                                                    row.topk if wants_topk else None))
        return output

    def fail_all(self) -> list[int]:
        """Drop every running request (after a failed step); returns their indices."""
        dropped = sorted(self.unfinished)
        for request in dropped:
            self.results.pop(request, None)
            self._forget(request)
        self.rows = {key: row for key, row in self.rows.items() if row.request not in self.unfinished}
        self.unfinished.clear()
        self._reset()
        return dropped

    def _forget(self, request: int) -> None:
        del self.requests[request], self.names[request], self.generators[request]

    def _reset(self) -> None:
        self.active, self.cache, self.logits = [], None, None


def _row_names(names: Sequence[str | None]) -> list[str] | None:
    """Per-row adapter names for the model, or None when every row runs the active adapter."""
    named = [name for name in names if name is not None]
    if not named:
        return None
    if len(named) < len(names):
        raise ValueError("a batch cannot mix named adapters with the active one")
    return named


def _mergeable(cache: Any) -> bool:
    layers: Any = getattr(cache, "layers", None)
    return bool(layers) and all(
        type(layer).__name__ == "DynamicLayer" and isinstance(getattr(layer, "keys", None), torch.Tensor)
        for layer in layers
    )


def _left_pad_cache(cache: Any, pad: int) -> None:
    if pad <= 0:
        return
    for layer in cache.layers:
        layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, pad, 0))
        layer.values = torch.nn.functional.pad(layer.values, (0, 0, pad, 0))


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))


def _choose_tokens(
    logits: torch.Tensor, rows: list[_Row], requests: Mapping[int, SampleRequest],
    generators: Mapping[int, torch.Generator],
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
        top_ids, top_values = top_logprobs(predicting, request.topk_prompt_logprobs)
        pairs = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
        output.topk_prompt_logprobs = [[], *pairs]
    return keep_last_prompt_positions(output, request.prompt_logprobs_last_n)


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
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            if not 0 <= getattr(request, name) <= vocab_size:
                problems.append(f"request {index} has {name} {getattr(request, name)} (0 to {vocab_size})")
    if problems:
        raise InvalidRequest("Invalid sample request: " + "; ".join(problems[:10]) + ".", problems=len(problems))
