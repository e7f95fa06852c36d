"""Recovery end to end: a dead rank of a Ray device group, a hung op, and a Redis that dies and comes back.

(A killed pool worker is covered in test_foundation.py.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.harness import LaunchedServer, free_port, mock_config
from tests.private_redis import PrivateRedis
from twinkle.records import ModelRecord

pytestmark = pytest.mark.e2e
PIDS = re.compile(r"device group \S+: 2 ranks .*, pids \[(\d+), (\d+)\]")
CHECKPOINT = re.compile(r"tinker://\S+?/weights/[\w.:=+-]+")


def eventually(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def private_server(tmp: Path, model_dir: Path, **kw: Any) -> tuple[LaunchedServer, PrivateRedis]:
    """A server on a redis-server of its own: nothing shared with other test runs on this machine."""
    broker = PrivateRedis(tmp)
    broker.start()
    config = mock_config(model_dir, tmp / "checkpoints", port=free_port(), db=0, **kw)
    config["broker"]["url"] = broker.url
    return LaunchedServer(config, tmp / "server.yaml", tmp / "server.log"), broker


def stop(server: LaunchedServer, broker: PrivateRedis) -> None:
    server.stop()
    if broker.proc is not None and broker.proc.poll() is None:
        broker.kill()


@pytest.fixture(scope="module")
def ray_pool(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
             ray_address: str) -> Iterator[LaunchedServer]:
    """A mock model pool of two data-parallel ranks on the session's Ray instance, snapshotting every second."""
    server, broker = private_server(tmp_path_factory.mktemp("ray-pool"), tiny_model_dir,
                                    adapter_config={"snapshot_interval": 1})
    model_args = server.config["applications"][1]["args"]
    model_args["device_group"] = {"name": "model", "ranks": 2, "device_type": "cpu"}
    model_args["device_mesh"] = {"dp_size": 2}
    server.config["ray"] = {"address": ray_address}
    server.start(timeout=240)
    yield server
    stop(server, broker)


def test_a_dead_rank_restarts_the_pool_and_the_adapter_resumes_from_its_automatic_snapshot(
        ray_pool: LaunchedServer) -> None:
    with ray_pool.client("tml-ranks") as c:
        model = new_model(c)
        data = [datum([5 + (i * 7) % 50 for i in range(k, k + 16)]) for k in range(3)]  # shards of 2 and 1
        losses = []
        for _ in range(4):
            fb = c.post("/forward_backward", json=fb_body(model, data)).json()["request_id"]
            opt = c.post("/optim_step", json={"model_id": model, "adam_params": {"learning_rate": 0.05}}).json()
            losses.append(wait(c, fb)["metrics"]["loss:sum"])
            assert "error" not in wait(c, opt["request_id"])
        assert losses[-1] < losses[0]
        snapshot = eventually(lambda: ModelRecord.from_hash(ray_pool.redis.hgetall(ray_pool.keys.model(model)))
                              .last_checkpoint, 20, "an automatic snapshot")
        assert "/weights/auto-snapshot-" in snapshot
        first_group = PIDS.search(ray_pool.log())
        assert first_group, ray_pool.log()[-3000:]
        os.kill(int(first_group.group(2)), signal.SIGKILL)  # rank 1
        eventually(lambda: "exited with code 75 (a rank of its Ray device group died)" in ray_pool.log(), 60,
                   "the pool to exit for a restart")
        eventually(lambda: len(PIDS.findall(ray_pool.log())) >= 2, 120, "a new device group")
        lost = wait(c, c.post("/forward_backward", json=fb_body(model, data)).json()["request_id"])
        assert lost["category"] == "server" and lost["code"] == "adapter_state_lost"
        named = CHECKPOINT.search(lost["error"])
        assert named and "auto-snapshot-" in named.group(0), lost["error"]
        load = c.post("/load_weights", json={"model_id": model, "path": named.group(0), "optimizer": True})
        assert "error" not in wait(c, load.json()["request_id"])
        resumed = wait(c, c.post("/forward_backward", json=fb_body(model, data)).json()["request_id"])
        assert resumed["metrics"]["loss:sum"] < losses[0]


@pytest.fixture(scope="module")
def hang_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server, broker = private_server(tmp_path_factory.mktemp("hang"), tiny_model_dir,
                                    queue_config={"execution_timeout": 1.0})
    server.start()
    yield server
    stop(server, broker)


def test_an_op_past_its_execution_timeout_fails_and_the_pool_restarts(hang_server: LaunchedServer) -> None:
    with hang_server.client("tml-hang") as c:
        model = new_model(c)
        # 2M tokens: about 3 s on the mock on an idle 2-core machine (half of it took 1.3-1.6 s, too near the limit)
        slow = [datum([(7 * i) % 500 + 3 for i in range(2000)]) for _ in range(1024)]
        hung = c.post("/forward_backward", json=fb_body(model, slow)).json()["request_id"]
        behind = c.post("/optim_step", json={"model_id": model, "adam_params": {}}).json()["request_id"]
        started = time.time()
        failed = wait(c, hung)
        assert failed["category"] == "server" and "execution_timeout of 1 s" in failed["error"], failed
        assert time.time() - started < 30
        assert wait(c, behind)["code"] == "adapter_state_lost"  # the restarted pool lost the adapter
        assert "exited with code 76 (an op ran past its execution_timeout)" in hang_server.log()
        fresh = new_model(c)
        assert "metrics" in wait(c, c.post("/forward_backward", json=fb_body(fresh, [datum([1, 2, 3])])).json()[
            "request_id"])


@pytest.fixture(scope="module")
def flaky_redis(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
                ) -> Iterator[tuple[LaunchedServer, PrivateRedis]]:
    server, broker = private_server(tmp_path_factory.mktemp("flaky-redis"), tiny_model_dir)
    server.start()
    yield server, broker
    stop(server, broker)


def test_a_redis_restart_gives_clear_503s_then_service_resumes_and_lost_futures_fail(
        flaky_redis: tuple[LaunchedServer, PrivateRedis]) -> None:
    server, broker = flaky_redis
    with server.client("tml-flaky") as c:
        model = new_model(c)
        slow = [datum([(7 * i) % 500 + 3 for i in range(2000)]) for _ in range(64)]
        running = c.post("/forward_backward", json=fb_body(model, slow)).json()["request_id"]
        queued = c.post("/optim_step", json={"model_id": model, "adam_params": {}}).json()["request_id"]
        broker.kill()
        for call in (lambda: c.get("/healthz"), lambda: c.post("/retrieve_future", json={"request_id": queued}),
                     lambda: c.post("/create_session", json={"tags": [], "sdk_version": "test"})):
            began = time.time()
            down = call()
            assert down.status_code == 503, down.text
            assert down.headers["Retry-After"] == "2" and down.json()["code"] == "broker_unavailable"
            assert time.time() - began < 15
        broker.start()  # empty: no persistence, every queued message and record is gone
        eventually(lambda: _ok(c), 30, "the API to answer again")
        for request_id in (running, queued):  # answered, not pending forever
            gone = c.post("/retrieve_future", json={"request_id": request_id}, timeout=60).json()
            assert gone.get("code") == "request_lost", gone
        # the worker reconnected: a new session and model train again (within a bounded time)
        fresh = eventually(lambda: _try_new_model(c), 90, "the pool to serve again")
        assert "metrics" in wait(c, c.post("/forward_backward", json=fb_body(fresh, [datum([1, 2, 3])])).json()[
            "request_id"])


def _ok(c: httpx.Client) -> bool:
    return c.get("/healthz").status_code == 200


def _try_new_model(c: httpx.Client) -> str | None:
    sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    r = c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen", "lora_config": {"rank": 4}})
    if r.status_code != 200:
        return None
    deadline = time.time() + 20
    while time.time() < deadline:
        body = c.post("/retrieve_future", json={"request_id": r.json()["request_id"]}).json()
        if body.get("type") != "try_again":
            return str(body["model_id"]) if "model_id" in body else None
    return None
