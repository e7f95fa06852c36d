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
    export: dict[str, Any] | None = None
    """Its merged export's check once export_merged ran: status, max_abs_diff (the largest logprob difference of
    the PEFT adapter and the merged model against the server's), tolerance, the merged model's size."""

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


class ImportedAdapter(Reply):
    """An uploaded PEFT adapter (TwinkleClient.import_adapter): a training run of this key holding it as a
    training checkpoint (`twinkle_path`) and a sampler checkpoint (`twinkle_sampler_path`)."""

    training_run_id: str
    path: str
    sampler_path: str
    base_model: str
    lora_rank: int
    lora_config: dict[str, Any] = Field(default_factory=dict)
    """The adapter's LoRA settings, for add_adapter_to_model(name, lora_config)."""
    size_bytes: int | None = None
    ignored_files: list[str] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def twinkle_path(self) -> str:
        return as_twinkle_path(self.path)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def twinkle_sampler_path(self) -> str:
        return as_twinkle_path(self.sampler_path)


class MergedExport(Reply):
    """A checkpoint's LoRA merged into the base weights on the server (TwinkleClient.export_merged), verified:
    loaded as a user loads it, it gives the server's logprobs within the tolerance."""

    path: str
    status: str
    export: dict[str, Any] = Field(default_factory=dict)
    """status, max_abs_diff, tolerance, adapter / merged (each's status and max_abs_diff), seconds."""
    files: list[str] = Field(default_factory=list)
    size_bytes: int = 0

    @property
    def max_abs_diff(self) -> float | None:
        value = self.export.get("max_abs_diff")
        return float(value) if isinstance(value, (int, float)) else None


class MergedUrls(Reply):
    """Signed URLs (no API key needed) of a verified merged export's files, until `expires`."""

    urls: dict[str, str]
    expires: datetime
    export: dict[str, Any] = Field(default_factory=dict)


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
