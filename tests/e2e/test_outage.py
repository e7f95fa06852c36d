"""Faults injected for real: a Redis of the test's own stops and starts again, repeatedly, and a pool
worker is frozen with SIGSTOP. The server never stops, answers 503 + Retry-After (never 500) while Redis is
away, every future ends terminal, and new ops work once it is back."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_foundation import datum, fb_body, new_model
from tests.harness import LaunchedServer, free_port, mock_config
from tests.private_redis import PrivateRedis
from twinkle.server.hang_watch import STALL_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SLOW = [datum([(7 * i) % 500 + 3 for i in range(2000)]) for _ in range(16)]  # about a second on mock


def settle(c: httpx.Client, request_id: str, timeout: float = 90) -> dict[str, Any]:
    """The future's final answer, riding out 503s while the broker is away (bounded)."""
    deadline = time.time() + timeout
    r = None
    while time.time() < deadline:
        r = c.post("/retrieve_future", json={"request_id": request_id})
        assert r.status_code in (200, 503), r.text  # never a 500
        if r.status_code == 503:
            assert r.headers["Retry-After"] and r.json()["code"] == "broker_unavailable"
            time.sleep(0.5)
            continue
        body: dict[str, Any] = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError(f"future {request_id} not terminal after {timeout} s: {r.text if r else ''}")


def submit(c: httpx.Client, path: str, body: dict[str, Any], timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while True:
        r = c.post(path, json=body)
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            return str(r.json()["request_id"])
        assert time.time() < deadline, f"{path} still 503 after {timeout} s"
        time.sleep(0.2)


def first_op_after_return(c: httpx.Client, model: str, timeout: float = 30) -> float:
    """Seconds from now until a fresh op is accepted and completes."""
    began = time.time()
    body = settle(c, submit(c, "/forward", {"model_id": model, "forward_input": {
        "data": [datum([1, 2, 3])], "loss_fn": "cross_entropy"}}), timeout)
    assert "error" not in body, body
    return time.time() - began


def settled_in_broker(server: LaunchedServer, request_id: str) -> None:
    """Wait until the op's message sits in its queue or in `unacked`. A message a worker popped within the last
    millisecond before Redis died, before kombu wrote it to `unacked`, is lost however durable Redis is (kombu's
    BRPOP/ack gap): that future fails as `request_lost` (terminal), which the other tests cover."""
    r = server.redis
    deadline = time.time() + 10
    while time.time() < deadline:
        if any(request_id.encode() in raw for raw in [*r.lrange("model.models-tiny.0", 0, -1), *r.hvals("unacked")]):
            return
        time.sleep(0.02)
    raise AssertionError(f"{request_id} never reached the broker")


def freeze_mid_op(server: LaunchedServer, worker: int, request_ids: list[str]) -> str:
    """SIGSTOP the worker while one of the ops runs (each takes only tens of ms on mock, so stop, look, and
    let it go on if it was between two ops); returns the op it froze in."""
    deadline = time.time() + 30
    while time.time() < deadline:
        os.kill(worker, signal.SIGSTOP)
        for request_id in request_ids:
            if server.redis.hget(server.keys.future(request_id), "status") == b"running":
                return request_id
        os.kill(worker, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError("no op was running whenever the worker was stopped")


@pytest.fixture(scope="module")
def durable(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
            ) -> Iterator[tuple[LaunchedServer, PrivateRedis]]:
    """A server on a Redis of its own with appendonly yes."""
    tmp = tmp_path_factory.mktemp("outage")
    broker = PrivateRedis(tmp / "redis", appendonly=True)
    broker.start()
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=0,
                         queue_config={"execution_timeout": 10})
    config["broker"]["url"] = broker.url
    server = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log")
    server.start()
    yield server, broker
    server.stop()
    broker.kill()


def test_repeated_redis_outages_never_stop_the_server_and_running_and_queued_ops_complete(
        durable: tuple[LaunchedServer, PrivateRedis]) -> None:
    server, broker = durable
    with server.client("tml-outage") as c:
        model = new_model(c)
        worker = server.worker_pid()
        submitted: list[str] = []
        for seconds in (3, 5, 3):
            running = submit(c, "/forward_backward", fb_body(model, SLOW))
            queued = submit(c, "/optim_step", {"model_id": model, "adam_params": {"learning_rate": 0.01}})
            submitted += [running, queued]
            settled_in_broker(server, queued)
            broker.kill()
            for call in (lambda: c.get("/healthz"), lambda q=queued: c.post("/retrieve_future", json={"request_id": q}),
                         lambda: c.post("/forward", json={"model_id": model, "forward_input": {
                             "data": [datum([1, 2, 3])], "loss_fn": "cross_entropy"}})):
                down = call()
                assert down.status_code == 503, down.text
                assert down.headers["Retry-After"] and down.json()["code"] == "broker_unavailable"
            time.sleep(seconds)
            broker.start()
            assert first_op_after_return(c, model) < 30
        outcomes = {rid: settle(c, rid) for rid in submitted}
        assert all("error" not in body for body in outcomes.values()), outcomes  # appendonly: nothing lost
        assert server.proc is not None and server.proc.poll() is None
        assert server.worker_pid() == worker and "exited with code" not in server.log()  # it kept its adapters


def test_a_worker_that_dies_while_redis_is_down_is_restarted_once_it_returns(
        durable: tuple[LaunchedServer, PrivateRedis]) -> None:
    server, broker = durable
    with server.client("tml-outage-kill") as c:
        model = new_model(c)
        running = submit(c, "/forward_backward", fb_body(model, SLOW))
        worker = server.worker_pid()
        broker.kill()
        os.kill(worker, signal.SIGKILL)
        time.sleep(3)  # the supervisor sees the death while it cannot restore the queue
        broker.start()
        back = c.post("/create_session", json={"tags": [], "sdk_version": "test"})
        assert back.status_code == 200, back.text  # the API is back at once
        assert "error" not in settle(c, submit(c, "/forward_backward", fb_body(new_model(c), [datum([1, 2, 3])])))
        assert settle(c, running).get("code") in ("adapter_state_lost", None)  # terminal either way
        assert server.proc is not None and server.proc.poll() is None
        assert "restarts once it is back" in server.log()


def test_a_frozen_worker_is_caught_from_outside_its_op_times_out_and_queued_ops_run(
        durable: tuple[LaunchedServer, PrivateRedis]) -> None:
    server, _broker = durable
    with server.client("tml-frozen") as c:
        model, other = new_model(c), new_model(c)
        steps = [submit(c, "/forward_backward", fb_body(model, SLOW)) for _ in range(30)]  # tens of ms each
        worker = server.worker_pid()
        running = freeze_mid_op(server, worker, steps)
        began = time.time()
        try:
            # A consumer frozen inside BRPOP still gets the next message into its socket, where it dies with the
            # process (kombu's Redis transport; the lost-future check fails it as `request_lost`): the filler,
            # or a step still queued ahead of it, is that message, never `queued`.
            forward = {"model_id": other, "forward_input": {"data": [datum([1, 2, 3])], "loss_fn": "cross_entropy"}}
            filler, queued = submit(c, "/forward", forward), submit(c, "/forward", forward)
            failed = settle(c, running, timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the launcher killed it: the expected case
                os.kill(worker, signal.SIGCONT)
        assert failed["code"] == "execution_timeout" and failed["category"] == "server", failed
        # execution_timeout + grace; or, had it frozen before its liveness file named the op, the stall limit
        assert time.time() - began < max(10 + 3, STALL_SECONDS) + 10
        assert "hung (" in server.log()
        assert settle(c, filler).get("code") in ("adapter_state_lost", "request_lost", None)  # terminal
        assert settle(c, queued).get("code") in ("adapter_state_lost", None)  # it ran on the new worker
        assert "error" not in settle(c, submit(c, "/forward_backward", fb_body(new_model(c), [datum([1, 2, 3])])))
