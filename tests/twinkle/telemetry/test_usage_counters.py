"""Exact usage as OpenTelemetry counters: `twinkle.usage.<metric>` per tenant, model and task type."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.metrics")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, Sum
from opentelemetry.sdk.trace import TracerProvider

from twinkle.futures import FutureRecord, Op
from twinkle.telemetry import record_usage
from twinkle.telemetry.naming import usage_metric
from twinkle.telemetry.pipeline import install_pipeline, uninstall_pipeline
from twinkle.usage import METRICS


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    install_pipeline(TracerProvider(), MeterProvider(metric_readers=[reader]))
    yield reader
    uninstall_pipeline()


def op(owner: str, kind: str = Op.FORWARD_BACKWARD) -> FutureRecord:
    return FutureRecord(request_id="r-" + owner, op=kind, owner=owner, model_id="s1:train:0", queue="q")


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                assert isinstance(metric.data, Sum) and metric.data.is_monotonic, metric.name
                found[metric.name] = list(metric.data.data_points)
    return found


def test_each_metric_is_counted_per_tenant_model_and_task_type(reader: InMemoryMetricReader) -> None:
    record_usage(op("t-a"), "tiny-qwen", {"trained_tokens": 120, "pool_ms": 40})
    record_usage(op("t-a"), "tiny-qwen", {"trained_tokens": 30, "pool_ms": 10})
    record_usage(op("t-b", Op.SAMPLE), "tiny-qwen", {"sampled_tokens": 9, "sampled_prompt_tokens": 3, "pool_ms": 5})
    found = points(reader)
    trained = found[usage_metric("trained_tokens")]
    assert [(p.attributes, p.value) for p in trained] == [
        ({"tenant": "t-a", "model": "tiny-qwen", "task_type": "forward_backward"}, 150)]
    pool = {p.attributes["tenant"]: p.value for p in found["twinkle.usage.pool_ms"]}
    assert pool == {"t-a": 50, "t-b": 5}
    assert [p.value for p in found["twinkle.usage.sampled_tokens"]] == [9]
    assert "twinkle.usage.checkpoint_bytes" not in found  # nothing counted, nothing exported


def test_every_metered_quantity_has_its_counter_and_unknown_or_zero_amounts_are_skipped(
        reader: InMemoryMetricReader) -> None:
    record_usage(op("t-a"), "m", {name: 1 for name in METRICS} | {"made_up": 5, "forwarded_tokens": 0})
    found = points(reader)
    assert set(found) == {usage_metric(name) for name in METRICS if name != "forwarded_tokens"}


def test_without_telemetry_nothing_is_counted(reader: InMemoryMetricReader) -> None:
    uninstall_pipeline()  # telemetry off: no pipeline in the process
    record_usage(op("t-a"), "m", {"trained_tokens": 3})
    assert points(reader) == {}
