"""Compute types shared by the API, the workers, the backends and the clients.

This module is deliberately light: it imports numpy and the standard library only (no torch, FastAPI or
Celery), so that every process can use it. Arrays are numpy; token ids are int64, everything else
float32. Ragged per-datum values are lists of arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TextChunk:
    """A run of already-tokenized text."""

    tokens: np.ndarray  # int64 [T]


@dataclass(frozen=True)
class ImageChunk:
    """An encoded image (png/jpeg bytes) placed between text chunks."""

    data: bytes
    format: str = "png"
    expected_tokens: int | None = None


Chunk = TextChunk | ImageChunk


def chunks_from_tokens(tokens: list[int] | np.ndarray) -> list[Chunk]:
    return [TextChunk(np.asarray(tokens, dtype=np.int64))]


def token_ids(chunks: list[Chunk]) -> np.ndarray:
    """The text tokens of a model input, images left out (text-only models never see them)."""
    parts = [c.tokens for c in chunks if isinstance(c, TextChunk)]
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)


def input_length(chunks: list[Chunk]) -> int:
    """Tokens a model input occupies, counting each image as its expected token count."""
    return sum(len(c.tokens) if isinstance(c, TextChunk) else (c.expected_tokens or 0) for c in chunks)


@dataclass
class Datum:
    """One training example: the model input and the per-token inputs of the loss function.

    For the Tinker losses `loss_fn_inputs` holds `target_tokens` (int64 [T]) and `weights` (float32 [T])
    for cross entropy, or `target_tokens`, `logprobs` (sampling logprobs) and `advantages` for RL losses.
    """

    model_input: list[Chunk]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)

    def tokens(self) -> np.ndarray:
        return token_ids(self.model_input)

    def images(self) -> list[ImageChunk]:
        return [c for c in self.model_input if isinstance(c, ImageChunk)]


@dataclass
class ForwardBackwardInput:
    """A batch for `forward` / `forward_backward`."""

    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    disable_lora: bool = False  # `forward` only: run the bare base model (e.g. a DPO reference policy)


@dataclass
class ForwardBackwardOutput:
    """Per-datum outputs (`logprobs`, `elementwise_loss`, ...) and metrics keyed `name:reduction`."""

    loss_fn_outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
    loss_fn_output_type: str = "ArrayRecord"


@dataclass(frozen=True)
class AdamParams:
    """Per-step optimizer hyper-parameters (defaults as in the Tinker SDK)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 disables clipping


@dataclass(frozen=True)
class LoraSpec:
    """How to build one tenant's training run: a LoRA adapter (`mode="lora"`), or with `mode="full"` all the
    base model's own weights, trained while the run holds its pool exclusively (the train_* flags, rank and
    target modules then mean nothing)."""

    rank: int = 32
    alpha: float | None = None  # None: 32, so the LoRA scale is 32 / rank
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    target_modules: tuple[str, ...] | str | None = None  # None: derived from train_* flags
    dropout: float = 0.0
    mode: str = "lora"  # TRAINING_MODES

    @property
    def full(self) -> bool:
        return self.mode == "full"


TRAINING_MODES = ("lora", "full")


def lora_spec_from_dict(values: dict[str, Any]) -> LoraSpec:
    """A LoraSpec from its stored form (model records, checkpoint metadata); unknown keys are ignored."""
    known: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()
             if k in LoraSpec.__dataclass_fields__}
    return LoraSpec(**known)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True  # Tinker: stop=None means EOS only, stop=[] means no stop at all


@dataclass
class SampleRequest:
    """One prompt to complete `num_samples` times.

    `adapter_path` is a server-side directory holding sampler weights (None: the base model).
    Every logprob a sampler reports (sampled tokens, prompt tokens, top-k alternatives) is the raw model's
    log-softmax at temperature 1, whatever temperature / top_k / top_p the tokens were drawn with: the
    number `forward` computes for the same tokens on the same weights.
    """

    prompt: list[Chunk]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0  # the k most likely tokens at each sampled position
    prompt_logprobs_last_n: int | None = None  # score only the prompt's last n positions (None: all)
    adapter_path: str | None = None
    stream_channel: str | None = None  # set by the API only: a sampler pool publishes tokens there as they come


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    topk_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when topk_sample_logprobs > 0


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # first position is None
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_length: int = 0  # tokens in the prompt, set by the pool that served it


def keep_last_prompt_positions(output: SampleOutput, last_n: int | None) -> SampleOutput:
    """Blank the prompt (top-k) logprobs before the last `last_n` positions (`prompt_logprobs_last_n`)."""
    if last_n is None:
        return output
    if output.prompt_logprobs is not None:
        cut = max(0, len(output.prompt_logprobs) - last_n)
        blank: list[float | None] = [None] * cut
        output.prompt_logprobs = blank + output.prompt_logprobs[cut:]
    if output.topk_prompt_logprobs is not None:
        cut = max(0, len(output.topk_prompt_logprobs) - last_n)
        output.topk_prompt_logprobs = [[] for _ in range(cut)] + output.topk_prompt_logprobs[cut:]
    return output


@dataclass(frozen=True)
class ModelInfo:
    """What a backend tells the API about its base model."""

    model_name: str
    vocab_size: int
    max_context_length: int
    tokenizer_id: str | None
    arch: str
    eos_token_id: int | None = None


@dataclass(frozen=True)
class SaveRequest:
    """save_state / save_weights_for_sampler / save_weights_external as the API hands it to a pool."""

    name: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    include_optimizer: bool = True
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    sampling_session_id: str | None = None  # unnamed sampler save: the session to create
    consumed_train_samples: int | None = None  # Twinkle save(): recorded with the trainer state
    age_recipients: tuple[str, ...] = ()  # save_weights_external: encrypt every file to these (age)


@dataclass(frozen=True)
class LoadRequest:
    """load_state (and create-from-state) as the API hands it to a pool."""

    owner: str
    path: str  # tinker:// or twinkle:// path, already checked to belong to `owner`
    include_optimizer: bool = False
    lora: LoraSpec | None = None  # set when the load creates the adapter
    restore_trainer: bool = False  # Twinkle resume: also the schedule, counters and progress
    only_model: bool = False  # Twinkle resume_from_checkpoint(resume_only_model=True)
