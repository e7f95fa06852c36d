"""The numpy-only sampler: generates from the mock backend's bigram model (see backends/mock_model.py).

`BigramSampling` is the one generation routine; `MockBackend.sample` uses it with an adapter's in-memory
weights (or a full-parameter run's whole model) and `MockSampler` with weights loaded from sampler
checkpoints: a LoRA adapter, or a full-parameter checkpoint's whole model (`twinkle.full_checkpoint`).

Reported logprobs are the model's own (temperature 1), as the torch sampler reports them: a token is drawn
after temperature, top_k and then top_p, but its logprob, the prompt's logprobs (the first position has
none) and the top-k alternatives are the log-softmax of the unfiltered model, the numbers `forward` reports.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from twinkle.backends.mock_model import (
    ADAPTER_FILE,
    BASE_FILE,
    BigramBase,
    LoraWeights,
    load_adapter,
    load_base,
    next_token_logprobs,
    read_model_source,
    served_base,
    target_logprobs,
)
from twinkle.errors import InvalidRequest
from twinkle.full_checkpoint import is_full_checkpoint
from twinkle.types import (
    ImageChunk,
    ModelInfo,
    SampledSequence,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    StopReason,
    keep_last_prompt_positions,
    token_ids,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_TOPK_ROWS_PER_PASS = 64  # bounds the [rows, V] matrix top-k prompt logprobs need on large vocabularies
_UTF8_MARGIN = 4


class BigramSampling:
    """Generation, prompt scoring and stop handling for the bigram model."""

    def __init__(self, base: BigramBase, info: ModelInfo, model_dir: Path | None) -> None:
        self._base = base
        self._info = info
        self._model_dir = model_dir
        self._tokenizer: Tokenizer | None = None

    def sample(
        self, lora: LoraWeights | None, request: SampleRequest, *, base: BigramBase | None = None,
        rows: NextTokenRows | None = None,
    ) -> SampleOutput:
        """One request with `lora` on `base`: a whole model such as a full run's weights (None: the served one).
        `rows`: the caller's cache for these weights, which it promises never change (a loaded checkpoint)."""
        base = self._base if base is None else base
        prompt = self._prompt(request)
        params = request.params
        self._check_params(request, len(prompt))
        stop_ids = set(params.stop_token_ids)
        if params.stop_at_eos and self._info.eos_token_id is not None:
            stop_ids.add(self._info.eos_token_id)
        tokenizer = self._tokenizer_for_stop_strings() if params.stop_strings else None
        stop_strings = _StopStrings(tokenizer, params.stop_strings)
        rng = np.random.default_rng(params.seed)

        count = request.num_samples
        tokens: list[list[int]] = [[] for _ in range(count)]
        logprobs: list[list[float]] = [[] for _ in range(count)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(count)]
        sample_k = request.topk_sample_logprobs
        reasons: list[StopReason] = ["length"] * count
        last = np.full(count, prompt[-1], np.int64)
        active = np.arange(count)
        for _ in range(params.max_tokens):
            if not len(active):
                break
            if rows is None:
                model_lp = self._distribution(base, lora, last[active])
                chosen, chosen_lp = _draw(model_lp, params, rng)
            else:
                model_lp, chosen, chosen_lp = rows.draw(base, lora, last[active], params, rng)
            last[active] = chosen
            best = _best(model_lp, sample_k) if sample_k > 0 else [[] for _ in chosen]
            still_active = []
            for sample, token, logprob, top in zip(
                active.tolist(), chosen.tolist(), chosen_lp.tolist(), best, strict=True
            ):
                tokens[sample].append(token)
                logprobs[sample].append(logprob)
                tops[sample].append(top)
                if token in stop_ids or stop_strings.hit(sample, tokens[sample]):
                    reasons[sample] = "stop"
                else:
                    still_active.append(sample)
            active = np.array(still_active, np.int64)
        sequences = [
            SampledSequence(tokens=tokens[i], logprobs=logprobs[i], stop_reason=reasons[i],
                            topk_logprobs=tops[i] if sample_k > 0 else None)
            for i in range(count)
        ]
        output = SampleOutput(sequences=sequences)
        if request.prompt_logprobs:
            scored = target_logprobs(base, lora, prompt[:-1], prompt[1:]).logprobs
            output.prompt_logprobs = [None, *map(float, scored)]
        if request.topk_prompt_logprobs > 0:
            output.topk_prompt_logprobs = [[], *_top_k(base, lora, prompt[:-1], request.topk_prompt_logprobs)]
        return keep_last_prompt_positions(output, request.prompt_logprobs_last_n)

    @staticmethod
    def _distribution(base: BigramBase, lora: LoraWeights | None, prev: np.ndarray) -> np.ndarray:
        # Samples that share their last token share the next-token distribution: compute it once.
        unique, inverse = np.unique(prev, return_inverse=True)
        return next_token_logprobs(base, lora, unique)[inverse]

    def _prompt(self, request: SampleRequest) -> np.ndarray:
        if any(isinstance(chunk, ImageChunk) for chunk in request.prompt):
            raise InvalidRequest("The prompt has an image, but the mock model reads text only.")
        prompt = token_ids(request.prompt)
        if not len(prompt):
            raise InvalidRequest("The prompt is empty.", hint="Give at least one token to continue from.")
        vocab = self._info.vocab_size
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise InvalidRequest(f"The prompt has token ids outside [0, {vocab}).")
        return prompt

    def _check_params(self, request: SampleRequest, prompt_length: int) -> None:
        params = request.params
        problems = []
        if request.num_samples < 1:
            problems.append(f"num_samples must be at least 1, got {request.num_samples}")
        if params.max_tokens < 0:
            problems.append(f"max_tokens must be >= 0, got {params.max_tokens}")
        if not (np.isfinite(params.temperature) and params.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {params.top_p}")
        if params.top_k < -1:
            problems.append(f"top_k must be -1 or 0 (off) or a positive count, got {params.top_k}")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            if not 0 <= getattr(request, name) <= self._info.vocab_size:
                problems.append(f"{name} must be in [0, {self._info.vocab_size}], got {getattr(request, name)}")
        limit = self._info.max_context_length
        if prompt_length + params.max_tokens > limit:
            problems.append(
                f"the prompt has {prompt_length} tokens and max_tokens is {params.max_tokens}, "
                f"together over this model's context of {limit} tokens"
            )
        if problems:
            raise InvalidRequest("Invalid sampling request: " + "; ".join(problems) + ".")

    def _tokenizer_for_stop_strings(self) -> Tokenizer | None:
        if self._tokenizer is None and self._model_dir is not None:
            path = self._model_dir / "tokenizer.json"
            if path.is_file():
                from tokenizers import Tokenizer  # only models with stop strings pay for the import

                self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer


class NextTokenRows:
    """The next-token rows of weights that never change (the served base, a loaded checkpoint), with what
    drawing from them needs, kept once computed: a decode step is then a lookup and one pass over a row, not
    the model's whole next-token computation (most of a mock sample's time). Bounded in bytes, least recently
    used out. Draws are the ones `_draw` makes: the same rows, the same random numbers."""

    def __init__(self, vocab_size: int, budget_bytes: int = 64 << 20) -> None:
        self._limit = max(16, budget_bytes // (12 * vocab_size))  # a float32 row and a float64 cumulative one
        self._rows: OrderedDict[tuple[int, float, int, float], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def draw(
        self, base: BigramBase, lora: LoraWeights | None, prev: np.ndarray, params: SamplingParams,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The model's rows after `prev` [N, V], one token drawn from each, and its logprob under the model."""
        entries = [self._entry(base, lora, int(token), params) for token in prev.tolist()]
        model_lp = entries[0][0][None] if len(entries) == 1 else np.stack([row for row, _ in entries])
        cdf = None
        if params.temperature != 0:
            cdf = entries[0][1][None] if len(entries) == 1 else np.stack([cumulative for _, cumulative in entries])
        return model_lp, *_pick(model_lp, cdf, rng)

    def _entry(
        self, base: BigramBase, lora: LoraWeights | None, token: int, params: SamplingParams
    ) -> tuple[np.ndarray, np.ndarray]:
        key = (token, params.temperature, params.top_k, params.top_p)
        entry = self._rows.get(key)
        if entry is not None:
            self._rows.move_to_end(key)
            return entry
        model_lp = next_token_logprobs(base, lora, np.array([token], np.int64))
        cumulative = _cumulative(model_lp, params)[0] if params.temperature != 0 else np.empty(0)
        entry = self._rows[key] = (model_lp[0], cumulative)
        while len(self._rows) > self._limit:
            self._rows.popitem(last=False)
        return entry


class _StopStrings:
    """Detects stop strings in the decoded text of growing samples."""

    def __init__(self, tokenizer: Tokenizer | None, stop_strings: tuple[str, ...]) -> None:
        self._stops = tuple(stop for stop in stop_strings if stop)
        if self._stops and tokenizer is None:
            raise InvalidRequest(
                "Stop strings need a tokenizer, and this model has no tokenizer.json.",
                hint="Pass stop token ids instead of stop strings.",
            )
        self._tokenizer = tokenizer
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self._texts: dict[int, str] = {}

    def hit(self, sample: int, tokens: list[int]) -> bool:
        if not self._stops:
            return False
        previous = self._texts.get(sample, "")
        assert self._tokenizer is not None  # checked in __init__ whenever there are stop strings
        text = self._tokenizer.decode(tokens)
        self._texts[sample] = text
        # Only the newest token's text can complete a stop string; the margin covers a partial UTF-8
        # character at the end of the previous text that this token completed.
        start = max(0, len(previous) - self._longest - _UTF8_MARGIN)
        return any(stop in text[start:] for stop in self._stops)


class MockSampler:
    """A SamplerBackend on the mock model; adapters come from `save_weights_for_sampler` directories: a LoRA
    adapter served on the base model, or a full-parameter checkpoint served as the whole model.

    Loaded checkpoints are cached by resolved path and the weights file's stamp (size, mtime), so a directory
    rewritten in place is read again."""

    def __init__(
        self,
        model_dir_or_vocab: str | int | os.PathLike[str],
        *,
        max_cached_adapters: int = 4,
        max_length: int | None = None,
    ) -> None:
        source = read_model_source(model_dir_or_vocab, max_length)
        self.info = source.info
        self._base = served_base(source)
        self._sampling = BigramSampling(self._base, self.info, source.directory)
        self._base_rows = NextTokenRows(self.info.vocab_size)
        self._cache: OrderedDict[tuple[str, int, int], tuple[LoraWeights | BigramBase, NextTokenRows]] = OrderedDict()
        self._cache_size = max_cached_adapters

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        outputs = []
        for request in requests:
            weights, rows = self._weights(request.adapter_path)
            if isinstance(weights, BigramBase):
                outputs.append(self._sampling.sample(None, request, base=weights, rows=rows))
            else:
                outputs.append(self._sampling.sample(weights, request, rows=rows))
        return outputs

    def _weights(self, adapter_path: str | None) -> tuple[LoraWeights | BigramBase | None, NextTokenRows]:
        """The checkpoint's LoRA adapter, or its whole model for a full-parameter checkpoint, and the rows kept
        for it (a checkpoint's weights are read once and never change here: one rewritten is read again)."""
        if adapter_path is None:
            return None, self._base_rows
        directory = Path(adapter_path).resolve()
        full = is_full_checkpoint(directory)
        stamp = _stamp(directory / (BASE_FILE if full else ADAPTER_FILE))
        key = (str(directory), *stamp)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        for stale in [cached for cached in self._cache if cached[0] == key[0]]:
            del self._cache[stale]  # the directory was rewritten since
        weights: LoraWeights | BigramBase
        if full:
            weights = load_base(directory, self.info.vocab_size)
        else:
            weights, _ = load_adapter(directory, self._base)
        self._cache[key] = weights, NextTokenRows(self.info.vocab_size)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return self._cache[key]


def _stamp(path: Path) -> tuple[int, int]:
    """(size, mtime in ns) of `path`, or (-1, -1) when it is missing (loading then reports it)."""
    try:
        status = path.stat()
    except OSError:
        return -1, -1
    return status.st_size, status.st_mtime_ns


def _top_k(
    base: BigramBase, lora: LoraWeights | None, prev: np.ndarray, k: int
) -> list[list[tuple[int, float]]]:
    rows: list[list[tuple[int, float]]] = []
    for start in range(0, len(prev), _TOPK_ROWS_PER_PASS):
        rows.extend(_best(next_token_logprobs(base, lora, prev[start : start + _TOPK_ROWS_PER_PASS]), k))
    return rows


def _best(model_lp: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely (token, logprob) of each row of `model_lp` [rows, V], best first (ties: lower id)."""
    k = min(k, model_lp.shape[1])
    rows = []
    for row, ids in zip(model_lp, np.argpartition(-model_lp, k - 1, axis=1)[:, :k], strict=True):
        ranked = sorted(ids.tolist(), key=lambda token: (-row[token], token))
        rows.append([(token, float(row[token])) for token in ranked])
    return rows


def _draw(
    model_lp: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One token per row of `model_lp` [rows, V], drawn from the sampling distribution (temperature, top_k,
    top_p), and its logprob under the model's own distribution."""
    return _pick(model_lp, None if params.temperature == 0 else _cumulative(model_lp, params), rng)


def _cumulative(model_lp: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The cumulative mass of the sampling distribution over each row of `model_lp` [rows, V]."""
    cdf: np.ndarray = np.cumsum(np.exp(_sampling_distribution(model_lp, params)), axis=1)
    return cdf


def _pick(model_lp: np.ndarray, cdf: np.ndarray | None, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One token per row drawn by its cumulative mass `cdf` (None: greedy), and its logprob under the model."""
    rows = np.arange(len(model_lp))
    if cdf is None:
        chosen = model_lp.argmax(axis=1)
    else:
        threshold = rng.random(len(rows)) * cdf[:, -1]
        # The first id whose cumulative mass exceeds the threshold: never one with zero probability.
        chosen = (cdf <= threshold[:, None]).sum(axis=1)
    return chosen, model_lp[rows, chosen].astype(np.float64)


def _sampling_distribution(model_lp: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Log-probs after temperature, then top_k, then top_p (dropped ids at -inf), renormalised [rows, V]."""
    scaled = model_lp.astype(np.float64) / params.temperature
    vocab = scaled.shape[1]
    rows = np.arange(len(scaled))[:, None]
    if 0 < params.top_k < vocab:
        kept = np.argpartition(scaled, vocab - params.top_k, axis=1)[:, vocab - params.top_k :]
        restricted = np.full_like(scaled, -np.inf)
        restricted[rows, kept] = scaled[rows, kept]
        scaled = restricted
    scaled = _normalise(scaled)
    if params.top_p < 1:
        # Keep the most likely ids until their mass reaches top_p (always at least one).
        order = np.argsort(-scaled, axis=1, kind="stable")
        sorted_probs = np.exp(scaled[rows, order])
        dropped = np.zeros(scaled.shape, bool)
        np.put_along_axis(
            dropped, order, np.cumsum(sorted_probs, axis=1) - sorted_probs >= params.top_p, axis=1
        )
        scaled[dropped] = -np.inf
        scaled = _normalise(scaled)
    return scaled


def _normalise(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(axis=1, keepdims=True)
    normalised: np.ndarray = logits - (peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True)))
    return normalised
