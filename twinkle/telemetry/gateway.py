"""Telemetry of the API process (the `Gateway` deployment).

Every HTTP request is one server span named `twinkle.server.Gateway` (FastAPIInstrumentor, renamed) and
one sample of `twinkle.http.requests.total` / `twinkle.http.request.duration_seconds`. A request is
attributed to the pool it was meant for (Model, Sampler or Processor) once the API knows it: it queued an
op there, or that pool's admission control refused it; everything else the Gateway answered alone. The span
of a submit carries the request id, model id, session id and op, and the future record keeps its W3C
traceparent so that the long-poll for the result links back to it.

API keys never reach a span or a metric: only the tenant id (a one-way hash) does, and the credential
headers are masked even when an operator turns on header capture.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinkle.telemetry import naming
from twinkle.telemetry.celery_tracing import instrument_celery
from twinkle.telemetry.instruments import Instruments, instruments
from twinkle.telemetry.pipeline import ensure_pipeline

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import ASGIApp, Receive, Send

    from twinkle.config.server_config import ServerConfig

log = logging.getLogger("twinkle.telemetry")
SECRET_HEADERS = ["x-api-key", "authorization", "cookie", "set-cookie", "proxy-authorization"]


@dataclass
class RequestInfo:
    """Filled in while a request is handled; read by the metrics middleware when it is answered."""

    deployment: str = naming.GATEWAY


@dataclass
class GatewayTelemetry:
    instruments: Instruments
    pool_deployments: dict[str, str]  # application name -> deployment, for rate-limit rejections


_state: GatewayTelemetry | None = None
_request: ContextVar[RequestInfo | None] = ContextVar("twinkle_request_info", default=None)


def setup_api_telemetry(app: FastAPI, config: ServerConfig) -> None:
    """Trace and measure the FastAPI `app`; does nothing (and imports nothing) unless telemetry is enabled."""
    global _state
    if not config.telemetry.enabled:
        _state = None
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.metrics import NoOpMeterProvider

    pipeline = ensure_pipeline(config.telemetry, "api")
    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=pipeline.tracer_provider, meter_provider=NoOpMeterProvider(),
        server_request_hook=_name_gateway_span, exclude_spans=["receive", "send"],
        http_capture_headers_sanitize_fields=SECRET_HEADERS)
    instrument_celery(pipeline)
    pools = {a.name: naming.MODEL for a in config.model_apps()}
    pools.update({a.name: naming.SAMPLER for a in config.sampler_apps()})
    pools.update({a.name: naming.PROCESSOR for a in config.processor_apps()})
    _state = GatewayTelemetry(instruments(pipeline), pools)
    app.add_middleware(GatewayMetricsMiddleware)
    log.info("API telemetry initialized")


def _name_gateway_span(span: Any, scope: dict[str, Any]) -> None:
    if span is not None and span.is_recording():
        span.update_name(naming.span_name(naming.GATEWAY))
        span.set_attribute(naming.DEPLOYMENT, naming.GATEWAY)


class GatewayMetricsMiddleware:
    """Counts and times every HTTP request by deployment, route template and status code."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        state = _state
        if state is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info = RequestInfo()
        token = _request.set(info)
        scope.setdefault("state", {})  # created here, shared by the handler's scope copies: it holds the tenant
        status = 500  # what the client gets if the app fails before answering

        async def send_and_note_status(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                _tag_tenant(scope)  # now: the server span ends with the last byte of the body
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            _request.reset(token)
            attributes = {"deployment": info.deployment, "method": f"{scope.get('method', '')} {route_template(scope)}",
                          "status": str(status)}
            state.instruments.http_requests.add(1, attributes)
            state.instruments.http_duration.record(time.perf_counter() - started, attributes)


def route_template(scope: dict[str, Any]) -> str:
    """The matched route with its prefixes, as declared (`/api/v1/training_runs/{run_id}`): a metric label
    of bounded cardinality. Routers included under a prefix know only their own part of the path, so the
    prefix is what precedes that part, filled with this request's parameters, in the request's path."""
    route = scope.get("route")
    own = getattr(route, "path_format", None)
    if not own:
        return "unmatched"
    params = scope.get("path_params") or {}
    try:
        filled = own.format(**{k: v for k, v in params.items()})
    except (KeyError, IndexError, ValueError):
        return str(own)
    path = str(scope.get("path", ""))
    return path[: len(path) - len(filled)] + own if path.endswith(filled) else str(own)


def _tag_tenant(scope: dict[str, Any]) -> None:
    from opentelemetry import trace

    tenant = (scope.get("state") or {}).get("tenant")
    span = trace.get_current_span()
    if tenant and span.is_recording():
        span.set_attribute(naming.TENANT, str(tenant))


def submit_trace(request_id: str, op: str, model_id: str, queue: str, scope: str = "") -> str:
    """Tag the submitting request's span with the op it queued; the traceparent to keep in the future
    record ("" when telemetry is off)."""
    if _state is None:
        return ""
    from opentelemetry import propagate, trace

    deployment = naming.deployment_of_queue(queue)
    info = _request.get()
    if info is not None:
        info.deployment = deployment
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(naming.op_attributes(request_id, op, model_id or scope, queue))
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def link_future(record: Any) -> None:
    """Join a long-poll for `record` to the trace of the request that submitted it."""
    if _state is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attributes(naming.op_attributes(record.request_id, record.op, record.model_id, record.queue))
    if record.trace:
        submitted = trace.get_current_span(TraceContextTextMapPropagator().extract({"traceparent": record.trace}))
        context = submitted.get_span_context()
        if context.is_valid:
            span.add_link(context, {"twinkle.link": "submit"})
            span.set_attribute(naming.SUBMIT_TRACE_ID, format(context.trace_id, "032x"))


def record_rate_limit_rejection(pool: str, reason: str = "") -> None:
    """Count one request that admission control refused on `pool` (an application name)."""
    if _state is None:
        return
    deployment = _state.pool_deployments.get(pool, naming.GATEWAY)
    info = _request.get()
    if info is not None:
        info.deployment = deployment
    _state.instruments.rate_limit_rejections.add(1, {"deployment": deployment, "pool": pool, "reason": reason})

