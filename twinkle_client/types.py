"""What the server answers, as pydantic models (`model_dump()`, `model_dump_json(indent=2)` work on all).

Fields the server adds in later versions are kept (extra="allow"), so an older client still shows them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field

TINKER_SCHEME = "tinker://"
TWINKLE_SCHEME = "twinkle://"


def as_twinkle_path(path: str) -> str:
    """The `twinkle://` spelling of a checkpoint path (the server accepts both schemes everywhere)."""
    return TWINKLE_SCHEME + path[len(TINKER_SCHEME) :] if path.startswith(TINKER_SCHEME) else path


class Reply(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


# Server and runs.


class SupportedModel(Reply):
    """A base model the server serves."""

    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = False


class ServerCapabilities(Reply):
    supported_models: list[SupportedModel] = Field(default_factory=list)


class ModelCapacity(Reply):
    """LoRA slots of one base model: how many adapters can train on it at once, and how many are free."""

    model_name: str
    max_loras: int
    used_loras: int
    free_loras: int


class CapacityInfo(Reply):
    models: list[ModelCapacity] = Field(default_factory=list)


class Checkpoint(Reply):
    """A saved state of a training run. `twinkle_path` is what resume_from_checkpoint and samplers take."""

    checkpoint_id: str
    checkpoint_type: str = "training"
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, Any] | None = None
    expires_at: datetime | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def twinkle_path(self) -> str:
        return as_twinkle_path(self.tinker_path)


class TrainingRun(Reply):
    """One adapter trained on the server (a model created with add_adapter_to_model)."""

    training_run_id: str
    base_model: str
    model_owner: str = ""
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, Any] | None = None


class WeightsInfo(Reply):
    base_model: str
    is_lora: bool = True
    lora_rank: int | None = None


# Training.


class TrainConfig(Reply):
    """The adapter's training configuration as the server holds it (loss, optimizer, scheduler, ...)."""


class ForwardBackwardResult(Reply):
    """`loss` is the mean per target token; `logprobs` holds each input's target-token log-probabilities."""

    loss: float
    metrics: dict[str, Any] = Field(default_factory=dict)
    logprobs: list[list[float]] = Field(default_factory=list)


class ForwardOnlyResult(Reply):
    loss: float | None = None
    logprobs: list[list[float]] = Field(default_factory=list)


class StepResult(Reply):
    """`stepped` is False on the calls that only accumulate gradients (gradient_accumulation_steps > 1)."""

    stepped: bool
    cur_step: int
    grad_norm: float | None = None
    lr: float | None = None


class MetricResult(Reply):
    """Means since the previous calculate_metric call: loss, grad_norm, lr, cur_step, tokens, ..."""

    result: dict[str, Any] = Field(default_factory=dict)


class HubUpload(Reply):
    hub_model_id: str
    url: str | None = None


# Sampling.


class SampledSequence(Reply):
    tokens: list[int]
    logprobs: list[float] | None = None
    stop_reason: str = "length"
    text: str | None = None
    """The decoded tokens, when the sampler has a template (set_template)."""


class SampleResult(Reply):
    sequences: list[SampledSequence] = Field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
