"""The OpenTelemetry providers of one process: traces, metrics and logs, exported over OTLP or to the console.

Nothing here is imported unless telemetry is enabled, so a server without the `telemetry` extra pays
nothing. A process has one pipeline; the first caller builds it from the config and later callers (the API
and an embedded worker in one process, as in the tests) share it. Tests install their own providers with
in-memory exporters through `install_pipeline` before the server code asks for one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twinkle.errors import UserError

if TYPE_CHECKING:
    from twinkle.config.models import TelemetryConfig

log = logging.getLogger("twinkle.telemetry")
INSTRUMENTATION_SCOPE = "twinkle"

_lock = threading.Lock()
_current: Pipeline | None = None


@dataclass
class Pipeline:
    tracer_provider: Any
    meter_provider: Any
    logger_provider: Any = None
    _cache: dict[str, Any] = field(default_factory=dict)

    def tracer(self) -> Any:
        return self.tracer_provider.get_tracer(INSTRUMENTATION_SCOPE)

    def meter(self) -> Any:
        return self.meter_provider.get_meter(INSTRUMENTATION_SCOPE)

    def once(self, name: str, build: Any) -> Any:
        """`build()` the first time `name` is asked for in this process, the same object afterwards."""
        with _lock:
            if name not in self._cache:
                self._cache[name] = build()
            return self._cache[name]


def install_pipeline(tracer_provider: Any, meter_provider: Any, logger_provider: Any = None) -> Pipeline:
    """Use these providers for everything this process emits (tests: in-memory exporters)."""
    global _current
    with _lock:
        _current = Pipeline(tracer_provider, meter_provider, logger_provider)
        return _current


def uninstall_pipeline() -> None:
    global _current
    with _lock:
        _current = None


def current_pipeline() -> Pipeline | None:
    return _current


def ensure_pipeline(config: TelemetryConfig, role: str) -> Pipeline:
    """The process's pipeline, built from the `telemetry` config section on first use."""
    global _current
    with _lock:
        if _current is None:
            _current = _build(config, role)
            _set_globals(_current)
        return _current


def _build(config: TelemetryConfig, role: str) -> Pipeline:
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise UserError("telemetry.enabled is true but the OpenTelemetry SDK is not installed.",
                        hint="pip install 'twinkle[telemetry]' (opentelemetry-sdk, -exporter-otlp, "
                             "-instrumentation-fastapi, -instrumentation-celery), or set telemetry.enabled: false"
                        ) from exc
    resource = Resource.create({
        "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
        "twinkle.role": role,
        **config.resource_attributes,
        "service.name": config.service_name,
    })
    tracer_provider = TracerProvider(resource=resource)
    logger_provider = None
    if config.debug:
        span_exporter: Any = ConsoleSpanExporter()
        metric_exporter: Any = ConsoleMetricExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = config.otlp_endpoint.startswith("http://")
        span_exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=insecure)
        metric_exporter = OTLPMetricExporter(endpoint=config.otlp_endpoint, insecure=insecure)
        logger_provider = _otlp_logs(config.otlp_endpoint, insecure, resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=config.export_interval_ms)
    meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
    target = "the console" if config.debug else config.otlp_endpoint
    log.info("telemetry for %s exported to %s every %d ms", role, target, config.export_interval_ms)
    return Pipeline(tracer_provider, meter_provider, logger_provider)


def _otlp_logs(endpoint: str, insecure: bool, resource: Any) -> Any:
    """Ship Twinkle's own log records to the collector too (Loki in the LGTM stack), trace ids attached."""
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    provider = LoggerProvider(resource=resource)
    provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(endpoint=endpoint, insecure=insecure)))
    logging.getLogger("twinkle").addHandler(LoggingHandler(level=logging.INFO, logger_provider=provider))
    return provider


def _set_globals(pipeline: Pipeline) -> None:
    """Third-party instrumentation that does not take a provider argument uses the global ones."""
    from opentelemetry import metrics, trace

    trace.set_tracer_provider(pipeline.tracer_provider)
    metrics.set_meter_provider(pipeline.meter_provider)
