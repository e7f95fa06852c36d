"""The future record: one per accepted compute request, stored as a Redis hash.

The API creates it (`queued`), the worker that runs the op moves it to `running` and then to
`completed` or `failed`, and publishes on the request's done channel so that long-polls wake up.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from enum import StrEnum

from twinkle.records import HashRecord


class FutureStatus(StrEnum):
    QUEUED = "queued"  #: accepted and published, not started
    RUNNING = "running"  #: a worker is executing it
    COMPLETED = "completed"  #: result blob written
    FAILED = "failed"  #: error and category set

    @property
    def terminal(self) -> bool:
        return self in (FutureStatus.COMPLETED, FutureStatus.FAILED)


class Op(StrEnum):
    """The verbs: one name for the client method, the URL, the Celery task and the backend method."""

    CREATE_MODEL = "create_model"
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"
    LOAD_STATE = "load_state"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    SAMPLE = "sample"
    UNLOAD_MODEL = "unload_model"
    # Twinkle-native: the adapter's server-side training configuration and loop
    CONFIGURE = "configure"
    CLIP_GRAD_AND_STEP = "clip_grad_and_step"
    CALCULATE_METRIC = "calculate_metric"
    GET_TRAIN_CONFIGS = "get_train_configs"
    UPLOAD_TO_HUB = "upload_to_hub"
    # a checkpoint's LoRA merged into the base weights, checked and kept as a Hugging Face model directory
    EXPORT_MERGED = "export_merged"
    # processor pool
    ENCODE = "encode"


def new_request_id() -> str:
    """`<ms since epoch, hex>-<random>`: the creation time lets the API tell expired from unknown."""
    return f"{int(time.time() * 1000):x}-{secrets.token_hex(8)}"


def request_id_created_at(request_id: str) -> float | None:
    head, _, tail = request_id.partition("-")
    if not tail or len(head) > 12:
        return None
    try:
        return int(head, 16) / 1000
    except ValueError:
        return None


@dataclass
class FutureRecord(HashRecord):
    request_id: str
    op: str
    owner: str
    model_id: str
    queue: str
    status: str = FutureStatus.QUEUED
    ticket: int = 0  # position ticket in the pool queue, see twinkle.keys.Keys.queue_tickets
    seq_id: int = -1
    exec_index: int = 0  # the n-th op executed on its model (1-based), set when it starts running
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str = ""
    category: str = ""
    code: str = ""
    broker_run_id: str = ""  # Redis run_id at submit; a different one later means the queue was lost
    trace: str = ""  # W3C traceparent of the submitting request, for joining traces
    weight: float = 1.0  # the tenant's fair-share weight when it was accepted (its tier or key, twinkle.tenancy)

    @property
    def state(self) -> FutureStatus:
        return FutureStatus(self.status)
