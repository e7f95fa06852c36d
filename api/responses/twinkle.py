"""Answers of the Twinkle-native routes (api/routes/twinkle.py), and the results their futures come back with
through retrieve_future (workers/twinkle_ops.py). Their submits answer a `FutureHandle` (api/responses/tinker.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from api.responses.answer import Answer, JsonFloat
from twinkle.trainer import TrainConfig


class PoolCapacity(Answer):
    model_name: str
    max_loras: int
    used_loras: int
    free_loras: int


class CapacityInfo(Answer):
    models: list[PoolCapacity]


# -- results -------------------------------------------------------------------------------------------------


class TrainerProgress(Answer):
    cur_step: int
    consumed_train_samples: int
    gradient_accumulation_steps: int


class TrainConfigured(Answer):
    type: Literal["configure"]
    train_config: TrainConfig


class TrainConfigs(TrainerProgress):
    type: Literal["get_train_configs"]
    train_config: TrainConfig


class InputsForwarded(Answer):
    """The result of /twinkle/forward_backward (`type` forward_backward) and /twinkle/forward_only (forward)."""

    type: Literal["forward_backward", "forward"]
    loss: JsonFloat = Field(description="Loss per weighted token of the batch.")
    metrics: dict[str, JsonFloat]
    logprobs: list[list[JsonFloat]] = Field(description="Per input, per target token.")


class GradStep(Answer):
    type: Literal["clip_grad_and_step"]
    stepped: bool = Field(description="False while gradients still accumulate.")
    cur_step: int
    grad_norm: JsonFloat | None
    lr: float


class TrainMetrics(Answer):
    loss: JsonFloat | None
    grad_norm: JsonFloat | None
    lr: float
    cur_step: int
    tokens: int
    is_training: bool


class MetricsCalculated(Answer):
    type: Literal["calculate_metric"]
    result: TrainMetrics


class HubUpload(Answer):
    type: Literal["upload_to_hub"]
    hub_model_id: str
    url: str


class Encoded(Answer):
    type: Literal["encode"]
    features: list[dict[str, Any]] = Field(description="One InputFeature per row (input_ids, labels, ...).")
