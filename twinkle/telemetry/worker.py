"""Telemetry of a pool worker (the `Model`, `Sampler` or `Processor` deployment).

Each op runs inside a span named `twinkle.server.<Deployment>`, a child of the Celery consumer span and so
part of the trace of the HTTP request that submitted it. The runtime reports when an op starts (its queue
wait: `started_at - created_at` of the future record) and how it ended (execution time, status, tokens).
Model and sampler workers are candidates for the cleanup leader, which publishes the server-wide gauges.

Every hook returns at once when telemetry is off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import redis

from twinkle.catalog import Catalog, processor_queue
from twinkle.config.apps import Application, ModelApp, ProcessorApp, SamplerApp
from twinkle.keys import Keys
from twinkle.telemetry import naming
from twinkle.telemetry.celery_tracing import instrument_celery
from twinkle.telemetry.instruments import Instruments, instruments
from twinkle.telemetry.leader import CleanupLeader, ServerGauges
from twinkle.telemetry.pipeline import current_pipeline, ensure_pipeline

if TYPE_CHECKING:
    from celery import Celery

    from twinkle.config.server_config import ServerConfig
    from twinkle.futures import FutureRecord

log = logging.getLogger("twinkle.telemetry")
_NO_SPAN = contextlib.nullcontext()


@dataclass
class WorkerTelemetry:
    instruments: Instruments
    tracer: Any
    deployment: str
    model: str  # the base model the pool serves ("" for processors)
    leader: CleanupLeader | None = None
    started: dict[str, float] = field(default_factory=dict)  # request id -> perf_counter when it began
    lock: threading.Lock = field(default_factory=threading.Lock)


_state: WorkerTelemetry | None = None


def setup_worker_telemetry(config: ServerConfig, role: str, celery_app: Celery) -> None:
    """Trace and measure the pool `role` (an application name) served by `celery_app`; a no-op unless
    telemetry is enabled."""
    if not config.telemetry.enabled:
        return
    app = config.app(role)
    if isinstance(app, ProcessorApp):
        # A prefork pool runs ops in child processes: exporter threads and gRPC channels must be made
        # after the fork, in each child.
        from celery import signals

        def in_child(**_: Any) -> None:
            _start(config, app, celery_app, lead=False)

        signals.worker_process_init.connect(in_child, weak=False)
        return
    _start(config, app, celery_app, lead=True)


def _start(config: ServerConfig, app: Application, celery_app: Celery, *, lead: bool) -> None:
    global _state
    pipeline = ensure_pipeline(config.telemetry, app.name)
    instrument_celery(pipeline)
    catalog = Catalog(config)
    served = catalog.by_app(app.name)
    deployment = naming.MODEL if isinstance(app, ModelApp) else naming.SAMPLER if isinstance(app, SamplerApp) \
        else naming.PROCESSOR
    state = WorkerTelemetry(instruments(pipeline), pipeline.tracer(), deployment, served.name if served else "")
    if lead:
        r = redis.Redis.from_url(str(celery_app.conf.broker_url))
        keys = Keys(config.persistence.key_prefix)
        queues = [q for m in catalog.models.values() for q in [*m.model_queues, m.sampler_queue] if q]
        queues += [processor_queue(a.name) for a in config.processor_apps()]
        state.leader = CleanupLeader(r, keys).start()
        server = config.server_app()
        interval = float(server.args.server_config.metrics_update_interval) if server else 1.0
        gauges: ServerGauges = pipeline.once("server-gauges", lambda: ServerGauges(
            r, keys, queues, min_interval=interval).register(pipeline.meter()))
        gauges.leader = state.leader
    _state = state
    log.info("Worker telemetry initialized (%s, %s, pid %d)", app.name, deployment, os.getpid())


def stop_worker_telemetry() -> None:
    """Give up the leader lease (tests, and a clean shutdown) and stop reporting."""
    global _state
    if _state is not None and _state.leader is not None:
        _state.leader.stop()
    _state = None


def op_span(op: str, request_id: str, model_id: str = "") -> Any:
    """The span one op runs in (a context manager)."""
    state = _state
    if state is None:
        return _NO_SPAN
    attributes = naming.op_attributes(request_id, op, model_id, "")
    attributes[naming.DEPLOYMENT] = state.deployment
    if state.model:
        attributes["twinkle.base_model"] = state.model
    return state.tracer.start_as_current_span(naming.span_name(state.deployment), attributes=attributes)


def task_started(rec: FutureRecord) -> None:
    """The future `rec` just moved to running: record how long it waited in its queue."""
    state = _state
    if state is None:
        return
    with state.lock:
        state.started[rec.request_id] = time.perf_counter()
    if rec.created_at:
        state.instruments.task_wait.record(max(0.0, time.time() - rec.created_at), _metric_attributes(state, rec))


def annotate_op_span(rec: FutureRecord) -> None:
    """Name the op's tenant and queue on its task's span. Called from the task's own thread: the op may begin
    in another one (a model pool's scheduler thread), where this span is not the current one."""
    if _state is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({naming.TENANT: rec.owner, naming.QUEUE: rec.queue})


def task_finished(rec: FutureRecord, status: str, result: Any = None, error: Any = None) -> None:
    """The future `rec` reached `status` (completed / failed) with `result` or `error`."""
    state = _state
    if state is None:
        return
    with state.lock:
        began = state.started.pop(rec.request_id, None)
    attributes = _metric_attributes(state, rec)
    if began is not None:
        state.instruments.task_execution.record(time.perf_counter() - began, attributes)
    state.instruments.tasks.add(1, {**attributes, "status": str(status)})
    if result is not None:
        _count_tokens(state, rec.op, result)
    if error is not None:
        from opentelemetry import trace
        from opentelemetry.trace import StatusCode

        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute(naming.ERROR_CATEGORY, str(getattr(error, "category", "server")))
            span.set_status(StatusCode.ERROR, str(getattr(error, "code", "")) or type(error).__name__)


def record_usage(rec: FutureRecord, model: str, amounts: Mapping[str, int]) -> None:
    """Add what the op `rec` used to the `twinkle.usage.<metric>` counters, by tenant (the key's hash), base
    `model` and task type. Call it when `UsageLedger.record` returned True, so that a retried or redelivered
    op is counted once here too. A no-op unless this process exports telemetry."""
    pipeline = current_pipeline()
    if pipeline is None or not amounts:
        return
    counters = instruments(pipeline).usage
    attributes = {"tenant": str(rec.owner), "model": model, "task_type": str(rec.op)}
    for metric, amount in amounts.items():
        counter = counters.get(metric)
        if counter is not None and amount > 0:
            counter.add(int(amount), attributes)


def _metric_attributes(state: WorkerTelemetry, rec: FutureRecord) -> dict[str, str]:
    return {"deployment": state.deployment, "task_type": rec.op, "model": state.model}


def _count_tokens(state: WorkerTelemetry, op: str, result: Any) -> None:
    if op == "forward_backward":
        trained = trained_tokens(result)
        if trained:
            state.instruments.tokens_trained.add(trained, {"model": state.model})
    elif op == "sample":
        sampled = sum(len(s.tokens) for s in getattr(result, "sequences", ()))
        if sampled:
            state.instruments.tokens_sampled.add(sampled, {"model": state.model})


def trained_tokens(result: Any) -> int:
    """Target tokens of a forward_backward result: one log-prob per target token and datum."""
    outputs = getattr(result, "loss_fn_outputs", None)
    if outputs is not None:
        return sum(int(np.size(o.get("logprobs", next(iter(o.values()), ())))) for o in outputs if o)
    if isinstance(result, dict):  # Twinkle-native result
        return sum(len(row) for row in result.get("logprobs") or ())
    return 0
