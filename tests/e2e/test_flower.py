"""Flower started by `twinkle-server launch` (flower.enabled), read through its REST API while the pool works;
the same server runs with telemetry on, exporting to the console (`debug: true`), across real processes."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("flower")
pytest.importorskip("opentelemetry.instrumentation.celery")

from tests.harness import LaunchedServer, free_port, mock_config, require_redis

pytestmark = pytest.mark.e2e
USER, PASSWORD = "ops", "flower-pw-8d1e"
WORKER = re.compile(r"^model\.models-tiny\.0@")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    require_redis()
    tmp = tmp_path_factory.mktemp("flower")
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=8, processor=True)
    config["flower"] = {"enabled": True, "port": free_port(), "basic_auth": f"{USER}:{PASSWORD}"}
    config["telemetry"] = {"enabled": True, "debug": True, "export_interval_ms": 600000}
    launched = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log",
                              env={"OTEL_BSP_SCHEDULE_DELAY": "300"})  # console spans within 0.3 s
    launched.start()
    try:
        yield launched
    finally:
        launched.stop()


@pytest.fixture(scope="module")
def flower(server: LaunchedServer) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{server.config['flower']['port']}"
    with httpx.Client(base_url=base, auth=(USER, PASSWORD), timeout=10) as client:
        deadline = time.time() + 30
        while True:
            try:
                if client.get("/healthcheck").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, f"Flower did not come up:\n{server.log()[-3000:]}"
            time.sleep(0.2)
        yield client


def wait(c: httpx.Client, request_id: str) -> dict[str, Any]:
    while True:
        body: dict[str, Any] = c.post("/retrieve_future", json={"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return body


def datum(tokens: list[int]) -> dict[str, Any]:
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"},
                               "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"}}}


def online_workers(flower: httpx.Client) -> dict[str, bool]:
    response = flower.get("/api/workers", params={"status": "1"})
    assert response.status_code == 200, response.text
    status: dict[str, bool] = response.json()
    return status


def test_flower_lists_the_busy_pool_online_and_shows_finished_tasks_by_verb_and_model(
        server: LaunchedServer, flower: httpx.Client) -> None:
    assert httpx.get(f"{flower.base_url}/api/workers", timeout=10).status_code == 401  # basic auth is on
    deadline = time.time() + 30  # Flower learns of workers from their heartbeats (every 2 s)
    while not any(WORKER.match(name) and up for name, up in online_workers(flower).items()):
        assert time.time() < deadline, online_workers(flower)
        time.sleep(0.2)
    with server.client("tml-flower") as c:
        session = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        created = c.post("/create_model", json={"session_id": session, "base_model": "tiny-qwen",
                                                "lora_config": {"rank": 4}}).json()
        model = created["model_id"]
        wait(c, created["request_id"])
        big = [datum([(7 * i) % 500 + 3 for i in range(2000)]) for _ in range(64)]
        body = {"model_id": model, "forward_backward_input": {"data": big, "loss_fn": "cross_entropy"}}
        ids = [c.post("/forward_backward", json=body).json()["request_id"] for _ in range(4)]
        statuses: list[bytes | None] = []
        workers: dict[str, bool] = {}
        while not any(WORKER.match(name) and up for name, up in workers.items()):
            statuses = [server.redis.hget(server.keys.future(rid), "status") for rid in ids]
            assert b"queued" in statuses or b"running" in statuses, f"all ops ended first; Flower saw {workers}"
            if b"running" in statuses:
                workers = online_workers(flower)
            time.sleep(0.05)
        for rid in ids:
            assert "metrics" in wait(c, rid)
    deadline = time.time() + 30
    while True:
        tasks = flower.get("/api/tasks", params={"limit": 100}).json()
        done = {tid: t for tid, t in tasks.items() if tid in ids and t.get("state") == "SUCCESS"}
        if len(done) == len(ids) or time.time() > deadline:
            break
        time.sleep(0.3)
    assert set(done) == set(ids), tasks
    for task in done.values():
        assert task["name"] == "twinkle.forward_backward"
        assert model in str(task["kwargs"]) and WORKER.match(task["worker"])
        assert task["runtime"] > 0
    assert any(t["name"] == "twinkle.create_model" for t in tasks.values())


def test_flower_runs_as_a_supervised_child_without_its_password_on_a_command_line(server: LaunchedServer) -> None:
    psutil = pytest.importorskip("psutil")
    assert server.proc is not None
    children = psutil.Process(server.proc.pid).children(recursive=True)
    flower = [p for p in children if "twinkle.server.flower" in " ".join(p.cmdline())]
    assert len(flower) == 1
    assert all(PASSWORD not in " ".join(p.cmdline()) for p in children)
    assert f"Flower on http://127.0.0.1:{server.config['flower']['port']} (basic auth)" in server.log()


def test_the_console_exporter_shows_one_trace_across_the_api_and_worker_processes(server: LaunchedServer) -> None:
    with server.client("tml-console") as c:
        session = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        created = c.post("/create_model", json={"session_id": session, "base_model": "tiny-qwen"}).json()
        wait(c, created["request_id"])
    log = server.log()
    assert "Worker telemetry initialized (models-tiny, Model" in log
    assert "became cleanup leader" in log
    assert "Worker telemetry initialized (processor, Processor" in log  # in a prefork child of that pool
    expected = {"twinkle.server.Gateway", "apply_async/twinkle.create_model", "run/twinkle.create_model",
                "twinkle.server.Model"}
    same_trace: set[str] = set()
    deadline = time.time() + 20  # each process's BatchSpanProcessor flushes every 5 s
    while not same_trace >= expected and time.time() < deadline:
        time.sleep(0.5)
        spans = console_spans(server.log())
        worker = [s for s in spans if s["name"] == "twinkle.server.Model"
                  and s["attributes"].get("twinkle.request_id") == created["request_id"]]
        if worker:
            trace_id = worker[0]["context"]["trace_id"]
            same_trace = {s["name"] for s in spans if s["context"]["trace_id"] == trace_id}
    assert same_trace >= expected, same_trace


def console_spans(log: str) -> list[dict[str, Any]]:
    """The JSON objects ConsoleSpanExporter printed (one indented object per span) among the log lines."""
    spans = []
    decoder = json.JSONDecoder()
    for match in re.finditer(r'^\{\n\s+"name"', log, flags=re.MULTILINE):
        try:
            span, _ = decoder.raw_decode(log[match.start():])
        except ValueError:
            continue  # interleaved with another process's output
        spans.append(span)
    return spans


def test_the_launcher_plans_flower_when_enabled_and_alone_under_only_flower(tiny_model_dir: Path) -> None:
    from twinkle.config import parse_config
    from twinkle.server.launcher import plan_children

    raw = mock_config(tiny_model_dir, Path("/tmp/unused"), port=1, db=8)
    without = parse_config(raw)
    with_flower = parse_config({**raw, "flower": {"enabled": True}})
    assert "flower" not in [c.name for c in plan_children("cfg.yaml", without, None, None)]
    planned = plan_children("cfg.yaml", with_flower, None, None)
    assert [c.name for c in planned][-1] == "flower" and len(planned) == 3
    assert planned[-1].argv[1:] == ["-m", "twinkle.server.flower", "-c", "cfg.yaml"]
    assert [c.name for c in plan_children("cfg.yaml", without, "flower", None)] == ["flower"]


def test_flowers_api_is_open_without_credentials_only_when_no_basic_auth_is_configured(tiny_model_dir: Path) -> None:
    from twinkle.config import parse_config
    from twinkle.server.flower import flower_argv, flower_env

    raw = mock_config(tiny_model_dir, Path("/tmp/unused"), port=1, db=8)
    open_flower = parse_config({**raw, "flower": {"enabled": True, "port": 5600}})
    guarded = parse_config({**raw, "flower": {"enabled": True, "basic_auth": "a:b"}})
    assert flower_env(open_flower) == {"FLOWER_UNAUTHENTICATED_API": "true"} and flower_env(guarded) == {}
    assert not [a for a in flower_argv(open_flower) if a.startswith("--basic-auth")]
    assert "--basic-auth=a:b" in flower_argv(guarded) and "--port=5600" in flower_argv(open_flower)
    assert "kwargs" in next(a for a in flower_argv(guarded) if a.startswith("--tasks_columns=")).split(",")
