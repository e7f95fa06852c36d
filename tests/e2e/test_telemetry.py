"""Traces and metrics of a real request path, in one process: the FastAPI app, a Celery worker on the threads
pool running the real pool runtime on the mock backend, real Redis, OpenTelemetry's in-memory exporters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.instrumentation.fastapi")
pytest.importorskip("opentelemetry.instrumentation.celery")

from celery.contrib.testing.worker import start_worker
from fastapi.testclient import TestClient
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, Histogram, InMemoryMetricReader, Sum
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from api.app import create_app
from tests.harness import REDIS_HOST, REDIS_PORT, mock_config, require_redis
from twinkle.celery_app import make_celery
from twinkle.config import parse_config
from twinkle.futures import Op
from twinkle.keys import Keys
from twinkle.telemetry import setup_worker_telemetry, stop_worker_telemetry
from twinkle.telemetry.naming import METRICS
from twinkle.telemetry.pipeline import install_pipeline, uninstall_pipeline
from workers.pool import _register, build_runtime

pytestmark = pytest.mark.e2e
RAW_KEY = "tml-telemetry-SECRET-4f1c9e"
DB = 9
MAX_INPUT_TOKENS = 500


@pytest.fixture(scope="module")
def telemetry_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Drive a short training run through HTTP and hand over what the exporters saw."""
    require_redis()
    url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{DB}"
    redis.Redis.from_url(url).flushdb()
    raw = mock_config(tiny_model_dir, tmp_path_factory.mktemp("telemetry") / "checkpoints", port=0, db=DB,
                      max_loras=1, queue_config={"max_input_tokens": MAX_INPUT_TOKENS},
                      adapter_config={"page_host_mb": 0, "page_disk_mb": 0})  # no paging: a 2nd create fails
    raw["telemetry"] = {"enabled": True, "service_name": "twinkle-test"}
    config = parse_config(raw)
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    install_pipeline(tracer_provider, MeterProvider(metric_readers=[reader]))
    pool_app = config.app("models-tiny")
    runtime = build_runtime(config, pool_app, 0, redis.Redis.from_url(url), Keys(""))
    celery = make_celery(url)
    for op in Op:
        _register(celery, runtime, op)
    setup_worker_telemetry(config, "models-tiny", celery)
    app = create_app(config, url, long_poll_seconds=5)
    try:
        with start_worker(celery, pool="threads", concurrency=1, queues=[runtime.queue], perform_ping_check=False,
                          loglevel="WARNING", shutdown_timeout=30), TestClient(app) as http:
            yield {"ids": train(http), "spans": spans, "reader": reader, "url": url}
    finally:
        stop_worker_telemetry()
        uninstall_pipeline()
        CeleryInstrumentor().uninstrument()


def train(http: TestClient) -> dict[str, str]:
    headers = {"X-API-Key": RAW_KEY}

    def post(path: str, body: dict[str, Any]) -> Any:
        response = http.post(f"/api/v1{path}", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()

    def wait(request_id: str) -> Any:
        while True:
            body = post("/retrieve_future", {"request_id": request_id})
            if body.get("type") != "try_again":
                return body

    session = post("/create_session", {"tags": [], "sdk_version": "test"})["session_id"]
    created = post("/create_model", {"session_id": session, "base_model": "tiny-qwen", "lora_config": {"rank": 4}})
    model = created["model_id"]
    wait(created["request_id"])
    tokens = [5 + (i * 7) % 50 for i in range(24)]
    fb = post("/forward_backward", {"model_id": model, "forward_backward_input": {"data": [datum(tokens)] * 2,
                                                                                 "loss_fn": "cross_entropy"}})
    assert "metrics" in wait(fb["request_id"])
    wait(post("/optim_step", {"model_id": model, "adam_params": {"learning_rate": 0.01}})["request_id"])
    sample = post("/asample", {"base_model": "tiny-qwen", "sampling_params": {"max_tokens": 3},
                               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}})
    assert wait(sample["request_id"])["sequences"]
    too_big = {"data": [datum([3] * (MAX_INPUT_TOKENS + 2))], "loss_fn": "cross_entropy"}
    refused = http.post("/api/v1/forward_backward", json={"model_id": model, "forward_backward_input": too_big},
                        headers=headers)
    assert refused.status_code == 400 and "at most" in refused.json()["error"], refused.text
    one_too_many = post("/create_model", {"session_id": session, "base_model": "tiny-qwen"})  # max_loras is 1
    assert "error" in wait(one_too_many["request_id"])
    return {"session": session, "model": model, "forward_backward": fb["request_id"]}


def datum(tokens: list[int]) -> dict[str, Any]:
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"},
                               "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"}}}


def finished_spans(exporter: InMemorySpanExporter, done: Any, timeout: float = 10) -> list[ReadableSpan]:
    """Spans end a moment after the response that depends on them: wait until `done(spans)` holds."""
    deadline = time.monotonic() + timeout
    while True:
        spans = list(exporter.get_finished_spans())
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def test_one_forward_backward_is_one_trace_from_the_http_request_into_the_worker(
        telemetry_run: dict[str, Any]) -> None:
    rid = telemetry_run["ids"]["forward_backward"]

    def worker_span(spans: list[ReadableSpan]) -> ReadableSpan | None:
        return next((s for s in spans if s.name == "twinkle.server.Model"
                     and (s.attributes or {}).get("twinkle.request_id") == rid), None)

    spans = finished_spans(telemetry_run["spans"], lambda spans: worker_span(spans) is not None)
    op = worker_span(spans)
    assert op is not None and op.context is not None
    by_id = {s.context.span_id: s for s in spans if s.context is not None}
    chain = [op]
    while chain[-1].parent is not None:
        parent = by_id.get(chain[-1].parent.span_id)
        assert parent is not None, f"span {chain[-1].name} has a parent that was never exported"
        chain.append(parent)
    names = [s.name for s in chain]
    assert names == ["twinkle.server.Model", "run/twinkle.forward_backward", "apply_async/twinkle.forward_backward",
                     "twinkle.server.Gateway"], names
    assert {s.context.trace_id for s in chain if s.context is not None} == {op.context.trace_id}
    gateway = chain[-1]
    assert gateway.attributes is not None and op.attributes is not None
    assert gateway.attributes["http.route"] == "/api/v1/forward_backward"
    for span in (gateway, op):
        assert span.attributes["twinkle.request_id"] == rid
        assert span.attributes["twinkle.task_type"] == "forward_backward"
        assert span.attributes["twinkle.model_id"] == telemetry_run["ids"]["model"]
        assert span.attributes["twinkle.session_id"] == telemetry_run["ids"]["session"]
        assert str(span.attributes["twinkle.tenant"]).startswith("t")


def test_the_long_poll_for_a_result_links_to_the_trace_that_submitted_it(telemetry_run: dict[str, Any]) -> None:
    rid = telemetry_run["ids"]["forward_backward"]
    spans = list(telemetry_run["spans"].get_finished_spans())
    submit = next(s for s in spans if s.name == "twinkle.server.Gateway" and s.attributes
                  and s.attributes.get("http.route") == "/api/v1/forward_backward")
    polls = [s for s in spans if s.attributes and s.attributes.get("http.route") == "/api/v1/retrieve_future"
             and s.attributes.get("twinkle.request_id") == rid]
    assert polls and submit.context is not None
    for poll in polls:
        assert poll.context is not None and poll.context.trace_id != submit.context.trace_id
        assert [link.context.span_id for link in poll.links] == [submit.context.span_id]
        assert poll.attributes is not None
        assert poll.attributes["twinkle.submit_trace_id"] == format(submit.context.trace_id, "032x")


def metric_points(reader: InMemoryMetricReader) -> dict[str, tuple[Any, list[Any]]]:
    data = reader.get_metrics_data()
    assert data is not None
    found: dict[str, tuple[Any, list[Any]]] = {}
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                found[metric.name] = (metric.data, list(metric.data.data_points))
    return found


def value(points: list[Any], **attributes: str) -> float:
    """Sum of the points (counter values or histogram counts) whose attributes include `attributes`."""
    matching = [p for p in points if all(p.attributes.get(k) == v for k, v in attributes.items())]
    return sum(getattr(p, "count", None) if hasattr(p, "bucket_counts") else p.value for p in matching)


def test_every_seed_metric_is_exported_with_its_instrument_type_and_plausible_values(
        telemetry_run: dict[str, Any]) -> None:
    found = metric_points(telemetry_run["reader"])
    kinds = {"counter": Sum, "histogram": Histogram, "gauge": Gauge}
    for name, kind in METRICS.items():
        assert name in found, f"{name} was not exported; got {sorted(found)}"
        data, points = found[name]
        assert isinstance(data, kinds[kind]), (name, type(data))
        if kind == "counter":
            assert data.is_monotonic, name
        assert points, name
    http = found["twinkle.http.requests.total"][1]
    assert value(http, deployment="Model", method="POST /api/v1/forward_backward", status="200") == 1
    assert value(http, deployment="Model", method="POST /api/v1/forward_backward", status="400") == 1
    assert value(http, deployment="Model", method="POST /api/v1/asample", status="200") == 1
    assert value(http, deployment="Gateway", method="POST /api/v1/create_session", status="200") == 1
    latency = found["twinkle.http.request.duration_seconds"][1]
    assert all(0 < p.sum < 60 for p in latency)
    assert value(found["twinkle.task.execution_seconds"][1], deployment="Model", task_type="forward_backward") == 1
    waits = [p for p in found["twinkle.task.wait_seconds"][1] if p.attributes["task_type"] == "forward_backward"]
    assert waits and 0 <= waits[0].sum < 30
    tasks = found["twinkle.tasks.total"][1]
    assert value(tasks, task_type="forward_backward", status="completed") == 1
    assert value(tasks, task_type="create_model", status="failed") == 1
    assert value(found["twinkle.rate_limit.rejections.total"][1], deployment="Model", pool="models-tiny",
                 reason="max_input_tokens") == 1
    assert value(found["twinkle.tokens.trained"][1], model="tiny-qwen") == 2 * 23
    assert value(found["twinkle.tokens.sampled"][1], model="tiny-qwen") >= 1
    gauges = {name: found[name][1] for name in METRICS if METRICS[name] == "gauge"}
    assert [p.value for p in gauges["twinkle.sessions.active"]] == [1]
    assert [p.value for p in gauges["twinkle.models.active"]] == [1]
    assert [p.value for p in gauges["twinkle.futures.active"]] == [0]
    assert [(p.attributes["queue"], p.value) for p in gauges["twinkle.queue.depth"]] == [("model.models-tiny.0", 0)]


def test_no_span_or_metric_attribute_carries_the_api_key(telemetry_run: dict[str, Any]) -> None:
    texts: list[str] = []
    for span in telemetry_run["spans"].get_finished_spans():
        texts += [span.name, repr(dict(span.attributes or {})), repr(dict(span.resource.attributes))]
        texts += [repr(dict(event.attributes or {})) for event in span.events]
        texts += [repr(dict(link.attributes or {})) for link in span.links]
    for _, points in metric_points(telemetry_run["reader"]).values():
        texts += [repr(dict(p.attributes)) for p in points]
    assert len(texts) > 50
    leaked = [t for t in texts if RAW_KEY in t or RAW_KEY.removeprefix("tml-") in t]
    assert not leaked, leaked[:3]
