"""What POST /retrieve_future answers (api/routes/futures.py, docs/tinker_protocol.md#futures): `try_again`
while the op waits, its failure, or its result; fwd/bwd and sample results as protobuf when asked for."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from api.responses.answer import Answer, JsonFloat
from api.responses.tinker import ExportCheck
from api.responses.twinkle import (
    Encoded,
    GradStep,
    HubUpload,
    InputsForwarded,
    MetricsCalculated,
    TrainConfigs,
    TrainConfigured,
    TrainerProgress,
)

PROTOBUF = "application/x-protobuf"


class TryAgain(Answer):
    """The op has not finished: poll again at once (this poll already waited)."""

    type: Literal["try_again"]
    request_id: str
    queue_state: Literal["active", "paused_rate_limit", "paused_capacity"]
    queue_state_reason: str
    status: str = Field(description="`queued` or `running`.")


class OpFailure(Answer):
    """The op failed (the poll itself worked, so 200): final, like the SDK's RequestFailedError."""

    error: str
    category: Literal["user", "server"]
    code: str


class Tensor(Answer):
    data: list[JsonFloat | int]
    dtype: Literal["int64", "float32"]
    shape: list[int]


class ForwardBackwardResult(Answer):
    """A Tinker forward or forward_backward, as JSON (protobuf `tinker_public.ForwardBackwardOutput` when the
    poll accepts application/x-protobuf, which the SDK requires)."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, Tensor]] = Field(description="Per datum: `logprobs`, `elementwise_loss`, ...")
    metrics: dict[str, JsonFloat] = Field(description="Keyed `name:reduction`; `loss:sum` among them.")


class SampledSequence(Answer):
    tokens: list[int]
    logprobs: list[JsonFloat]
    stop_reason: Literal["stop", "length"]
    topk_logprobs: list[list[tuple[int, JsonFloat]]] | None = Field(
        default=None, description="Per token, (token id, logprob) of the most likely; with topk_sample_logprobs.")


class SampleResult(Answer):
    """An asample, as JSON (protobuf `tinker_public.SampleResponse` when asked for)."""

    type: Literal["sample"]
    sequences: list[SampledSequence]
    prompt_logprobs: list[JsonFloat | None] | None
    topk_prompt_logprobs: list[list[tuple[int, JsonFloat]]] | None


class ModelCreated(Answer):
    type: Literal["create_model"]
    model_id: str


class OptimStepped(Answer):
    type: Literal["optim_step"]
    metrics: dict[str, JsonFloat]


class WeightsSaved(Answer):
    type: Literal["save_weights"]
    path: str


class SamplerWeightsSaved(Answer):
    type: Literal["save_weights_for_sampler"]
    path: str
    sampling_session_id: str | None = Field(default=None, description="The sampler made for an unnamed save.")


class ExternalWeightsSaved(Answer):
    type: Literal["save_weights_external"]
    path: str
    size_bytes: int | None
    export: ExportCheck | None = Field(default=None, description="The adapter files' check, where the pool ran one.")


class WeightsLoaded(Answer):
    type: Literal["load_weights"]
    path: str
    model_id: str
    progress: TrainerProgress | None = Field(default=None, description="The trainer's, on a Twinkle resume.")


class ModelUnloaded(Answer):
    type: Literal["unload_model"]
    model_id: str


class MergedExported(Answer):
    type: Literal["export_merged"]
    path: str
    status: Literal["verified"]
    export: ExportCheck
    files: list[str]
    size_bytes: int


FutureResult = (ForwardBackwardResult | SampleResult | ModelCreated | OptimStepped | WeightsSaved
                | SamplerWeightsSaved | ExternalWeightsSaved | WeightsLoaded | ModelUnloaded | MergedExported
                | TrainConfigured | TrainConfigs | InputsForwarded | GradStep | MetricsCalculated | HubUpload | Encoded)
FutureAnswer = TryAgain | OpFailure | FutureResult

FUTURE_RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "model": FutureAnswer,
    "description": "`try_again`, the op's failure, or its result.",
    "content": {PROTOBUF: {"schema": {
        "type": "string", "format": "binary",
        "description": "A forward/forward_backward or sample result when the poll's Accept names "
                       "application/x-protobuf: tinker_public.ForwardBackwardOutput or SampleResponse "
                       "(Tinker SDK 0.38)."}}},
}}
