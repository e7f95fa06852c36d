"""Answers of the Tinker-protocol routes (api/routes/, docs/tinker_protocol.md) other than retrieve_future's
(api/responses/futures.py): bootstrap and sessions, submits, sampling sessions, runs and checkpoints, weight
exports and imports (downloads: api/responses/downloads.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api.responses.answer import Answer, OpenAnswer

CheckStatus = Literal["verified", "failed"]

# -- bootstrap and sessions ----------------------------------------------------------------------------------


class Health(Answer):
    status: Literal["ok"]
    instance: str | None = Field(default=None, description="Which launch started this API process; absent "
                                 "when it was not started by `twinkle-server launch`.")


class ClientConfig(OpenAnswer):
    """The SDK's flags: these defaults, plus whatever the operator's TWINKLE_TINKER_CLIENT_CONFIG sets."""

    pjwt_auth_enabled: bool
    use_pyqwest_transport: bool = Field(description="False unless the operator sets it: the SDK then uses "
                                        "httpx's own transport, whose requests cannot abort the client at exit.")


class DynamicConfig(Answer):
    refresh_interval_sec: int
    sample_cancel_enabled: bool


class ServedModel(Answer):
    model_name: str
    max_context_length: int | None
    trainable: bool
    sampleable: bool


class ServerCapabilities(Answer):
    supported_models: list[ServedModel]


class SessionCreated(Answer):
    type: Literal["create_session"]
    session_id: str


class HeartbeatAck(Answer):
    type: Literal["session_heartbeat"]


class Empty(Answer):
    """`{}`: done."""


class SessionList(Answer):
    sessions: list[str] = Field(description="Session ids of the caller, sorted.")


class SessionInfo(Answer):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None


class TelemetryAck(Answer):
    status: Literal["accepted"]


# -- training ------------------------------------------------------------------------------------------------


class FutureHandle(Answer):
    """An op accepted: its result comes from POST /retrieve_future with this `request_id`."""

    request_id: str
    model_id: str | None = Field(default=None, description="The training run the op is for; absent for ops "
                                 "of no run (encode).")


def future_handle(request_id: str, model_id: str | None = None) -> dict[str, str]:
    """A `FutureHandle` answer's body (`model_id` left out when empty)."""
    return {"request_id": request_id, "model_id": model_id} if model_id else {"request_id": request_id}


class ModelData(Answer):
    arch: str | None
    model_name: str
    tokenizer_id: str | None


class ModelInfo(Answer):
    type: Literal["get_info"]
    model_id: str
    model_data: ModelData
    is_lora: bool
    lora_rank: int | None = Field(description="None for a full-parameter run.")
    training_mode: Literal["lora", "full"]
    model_name: str


# -- sampling ------------------------------------------------------------------------------------------------


class SamplingSessionCreated(Answer):
    type: Literal["create_sampling_session"]
    sampling_session_id: str


class SamplerInfo(Answer):
    sampler_id: str
    base_model: str
    model_path: str | None


class SampleFuture(Answer):
    request_id: str
    sample_sequence_ids: list[str] = Field(description="`<request_id>:<i>`, one per sample, in order.")


# -- training runs and checkpoints ---------------------------------------------------------------------------


class LogprobCheck(Answer):
    """One side of an export's check: how far its logprobs are from the training pool's."""

    status: CheckStatus
    max_abs_diff: float | None = Field(description="None where it is infinite (shapes or NaN disagree).")


class MergedCheck(LogprobCheck):
    size_bytes: int
    shards: int
    dtype: str


class ExportCheck(Answer):
    """The check of a checkpoint's export (twinkle/merged_export.py): of its PEFT adapter files, and of its
    merged model once export_merged made one."""

    status: CheckStatus
    max_abs_diff: float | None
    tolerance: float
    adapter: LogprobCheck
    merged: MergedCheck | None = None
    seconds: float | None = None


class Checkpoint(Answer):
    """A checkpoint as its run's index keeps it (twinkle/checkpoints.py `index_entry`)."""

    checkpoint_id: str = Field(description="`weights/<name>`, `sampler_weights/<name>` or `external_weights/<name>`.")
    checkpoint_type: Literal["training", "sampler", "external"]
    time: str = Field(description="When it was saved (ISO 8601, UTC).")
    tinker_path: str
    size_bytes: int | None
    public: bool
    user_metadata: dict[str, str] | None
    expires_at: str | None
    export: ExportCheck | None = None


class Cursor(Answer):
    offset: int
    limit: int
    total_count: int


class CheckpointList(Answer):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = Field(default=None, description="On the listing of all the caller's checkpoints.")


class TrainingRun(Answer):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool
    lora_rank: int | None
    last_request_time: str
    last_checkpoint: Checkpoint | None
    last_sampler_checkpoint: Checkpoint | None
    user_metadata: dict[str, str] | None


class TrainingRunPage(Answer):
    training_runs: list[TrainingRun]
    cursor: Cursor


class WeightsInfo(Answer):
    base_model: str
    is_lora: bool
    lora_rank: int | None
    train_unembed: bool | None
    train_mlp: bool | None
    train_attn: bool | None


# -- weights in and out --------------------------------------------------------------------------------------


class ExportFuture(Answer):
    request_id: str
    path: str = Field(description="The checkpoint being merged.")


class CopiedCheckpoint(Answer):
    tinker_path: str


class ImportedLora(Answer):
    rank: int
    alpha: float | None
    dropout: float
    target_modules: list[str]


class ImportedAdapter(Answer):
    training_run_id: str
    path: str
    sampler_path: str
    base_model: str
    lora_rank: int
    lora_config: ImportedLora
    size_bytes: int | None
    ignored_files: list[str]
