"""Observability: OpenTelemetry traces and metrics for the API and the pool workers.

Configured by the `telemetry` section of the server config. With `enabled: false` (the default) every
hook below returns at once and no OpenTelemetry module is imported; the SDK and instrumentations are the
optional `telemetry` extra. Metric and span names follow the seed's "可观测化" page (see naming.py).
"""

from twinkle.telemetry.gateway import link_future, record_rate_limit_rejection, setup_api_telemetry, submit_trace
from twinkle.telemetry.worker import (
    annotate_op_span,
    op_span,
    record_usage,
    setup_worker_telemetry,
    stop_worker_telemetry,
    task_finished,
    task_started,
)

__all__ = [
    "annotate_op_span",
    "link_future",
    "op_span",
    "record_rate_limit_rejection",
    "record_usage",
    "setup_api_telemetry",
    "setup_worker_telemetry",
    "stop_worker_telemetry",
    "submit_trace",
    "task_finished",
    "task_started",
]
