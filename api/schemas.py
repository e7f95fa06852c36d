"""JSON request bodies of the HTTP API (Tinker SDK 0.38 shapes).

Unknown fields are ignored rather than refused so that newer SDKs keep working; every field the
server uses is typed and range-checked here, and anything wrong comes back as a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from twinkle.errors import InvalidRequest

# Sequence numbers become parts of ids (`<session>:train:<seq>`) and Redis keys: int64 keeps every id short
# enough to be addressed again (see MAX_ID_LENGTH).
MAX_SEQ_ID = 2**63 - 1
MAX_ID_LENGTH = 200  # the longest id any route accepts back (run ids in checkpoint paths, sampler ids)


def checked_new_id(value: str, what: str) -> str:
    """An id made from client input (a session id and a sequence number), refused at creation if it is too
    long to be addressed afterwards."""
    if len(value) > MAX_ID_LENGTH:
        raise InvalidRequest(f"The new {what} would be {len(value)} characters long; ids are at most "
                             f"{MAX_ID_LENGTH}.", hint="Use a smaller sequence number.")
    return value


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(Body):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionRef(Body):
    session_id: str = Field(max_length=200)


class FinishReason(Body):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishBody(Body):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: str | None = None


class LoraConfigBody(Body):
    rank: int = Field(default=32, ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    alpha: float | None = Field(default=None, gt=0)
    target_modules: list[str] | str | None = None


class OptimizerConfigBody(Body):
    type: str = "adamw"


class CreateModelBody(Body):
    session_id: str = Field(max_length=200)
    model_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ_ID)
    base_model: str = Field(max_length=500)
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody | None = None
    training_mode: Literal["lora", "full"] | None = None
    """`full`: train all the base model's weights, holding the pool exclusively (where its operator allows it).
    The Tinker SDK, which has no such field, sends it as user_metadata {"training_mode": "full"}."""


class ModelRef(Body):
    model_id: str = Field(max_length=300)


class AdamParamsBody(Body):
    learning_rate: float = Field(default=1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(default=0.9, ge=0, lt=1, allow_inf_nan=False)
    beta2: float = Field(default=0.95, ge=0, lt=1, allow_inf_nan=False)
    eps: float = Field(default=1e-12, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class OptimStepBody(Body):
    model_id: str = Field(max_length=300)
    seq_id: int | None = Field(default=None, le=MAX_SEQ_ID)
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(Body):
    model_id: str = Field(max_length=300)
    path: str | None = Field(default=None, max_length=200)
    seq_id: int | None = Field(default=None, le=MAX_SEQ_ID)
    ttl_seconds: int | None = Field(default=None, gt=0)
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerBody(Body):
    model_id: str = Field(max_length=300)
    path: str | None = Field(default=None, max_length=200)
    sampling_session_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ_ID)
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = Field(default=None, le=MAX_SEQ_ID)
    ttl_seconds: int | None = Field(default=None, gt=0)
    user_metadata: dict[str, str] | None = None


class SaveWeightsExternalBody(Body):
    model_id: str = Field(max_length=300)
    path: str = Field(max_length=200)
    seq_id: int | None = Field(default=None, le=MAX_SEQ_ID)
    ttl_seconds: int | None = Field(default=None, gt=0)
    age_encryption_recipients: list[str] | None = Field(default=None, max_length=10)


class ExportMergedBody(Body):
    path: str = Field(max_length=1000)


class CopyWeightsBody(Body):
    source_path: str = Field(max_length=1000)
    session_id: str | None = Field(default=None, max_length=200)
    model_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ_ID)
    destination_project_id: str | None = Field(default=None, max_length=200)
    ttl_seconds: int | None = Field(default=None, gt=0)
    weights_access_token: str | None = None


class LoadWeightsBody(Body):
    model_id: str | None = Field(default=None, max_length=300)
    seq_id: int | None = Field(default=None, le=MAX_SEQ_ID)
    session_id: str | None = Field(default=None, max_length=200)
    model_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ_ID)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str = Field(max_length=1000)
    optimizer: bool = False


class CreateSamplingSessionBody(Body):
    session_id: str = Field(max_length=200)
    sampling_session_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ_ID)
    base_model: str | None = Field(default=None, max_length=500)
    model_path: str | None = Field(default=None, max_length=1000)


class SampleBody(Body):
    num_samples: int = Field(default=1, ge=1, le=128)
    prompt: dict[str, Any]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    base_model: str | None = Field(default=None, max_length=500)
    model_path: str | None = Field(default=None, max_length=1000)
    sampling_session_id: str | None = Field(default=None, max_length=200)
    seq_id: int | None = Field(default=None, le=MAX_SEQ_ID)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=64)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=64)
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=0, description="not supported: must be 0")
    target_prompt_logprobs: None = Field(default=None, description="not supported: must be absent")
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1)
    record_stability_info: bool = False  # stable_reinforce: remember the sequences (api.provenance)


class RetrieveFutureBody(Body):
    request_id: str = Field(max_length=200)
    allow_metadata_only: bool = False


class WeightsInfoBody(Body):
    tinker_path: str = Field(max_length=1000)


class TtlBody(Body):
    ttl_seconds: int | None = Field(default=None, gt=0)
