"""A frozen or killed pool worker, for real: the op it froze in fails by execution_timeout from the op's record,
ops queued behind it fail by queue_timeout while still queued, and the hundreds of queued ops of an adapter it
took with it all end within seconds of its replacement starting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.e2e.test_foundation import datum, fb_body, new_model
from tests.e2e.test_outage import settle, submit
from tests.e2e.test_recovery import eventually, private_server, stop
from tests.harness import LaunchedServer
from twinkle import liveness
from twinkle.backlog import BacklogKeys
from twinkle.ledger.messages import UNACKED
from twinkle.liveness import Liveness

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
QUEUE = "model.models-tiny.0"
SMALL = [datum([1, 2, 3])]
SLOW = [datum([(7 * i) % 500 + 3 for i in range(2000)]) for _ in range(16)]  # tens of ms on mock
BUSY = SLOW * 32  # seconds on mock
EXECUTION_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def timed_pool(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server, broker = private_server(tmp_path_factory.mktemp("frozen-op"), tiny_model_dir,
                                    queue_config={"execution_timeout": EXECUTION_TIMEOUT})
    server.start()
    yield server
    stop(server, broker)


@pytest.fixture(scope="module")
def impatient_pool(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    """queue_timeout 3 s, and a window of 4 ops (so a key's ops past its share park in its backlog)."""
    server, broker = private_server(tmp_path_factory.mktemp("frozen-queue"), tiny_model_dir,
                                    queue_config={"queue_timeout": 3})
    server.config["applications"][1]["args"]["scheduling"] = {"window": 4}
    server.start()
    yield server
    stop(server, broker)


@pytest.fixture(scope="module")
def plain_pool(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server, broker = private_server(tmp_path_factory.mktemp("killed"), tiny_model_dir)
    server.start()
    yield server
    stop(server, broker)


def status(server: LaunchedServer, request_id: str) -> str:
    value = server.redis.hget(server.keys.future(request_id), "status")
    return value.decode() if value else ""


def freeze_once_begun(server: LaunchedServer, worker: int, request_id: str) -> None:
    """SIGSTOP the worker the moment the op's record says it began (polled every few ms)."""
    deadline = time.time() + 30
    while (now := status(server, request_id)) != "running":
        assert time.time() < deadline and now == "queued", now
        time.sleep(0.002)
    os.kill(worker, signal.SIGSTOP)


def stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def test_a_worker_frozen_right_after_it_began_an_op_fails_that_op_within_its_execution_timeout(
        timed_pool: LaunchedServer) -> None:
    with timed_pool.client("tml-frozen-op") as c:
        model = new_model(c)
        worker = timed_pool.worker_pid()
        liveness_file = psutil.Process(worker).environ()[liveness.ENV]
        op = submit(c, "/forward_backward", fb_body(model, SLOW))
        freeze_once_begun(timed_pool, worker, op)
        frozen_at = time.time()
        try:
            # The break reported: frozen before its liveness writer ran, the file names no op (or the one before).
            began = float(timed_pool.redis.hget(timed_pool.keys.future(op), "started_at") or 0)
            liveness.write(liveness_file, Liveness(pid=worker, t=began - 0.1, execution_timeout=EXECUTION_TIMEOUT))
            failed = settle(c, op, timeout=60)
            answered = time.time() - frozen_at
        finally:
            with contextlib.suppress(ProcessLookupError):  # the launcher killed it: the expected case
                os.kill(worker, signal.SIGCONT)
        assert failed["code"] == "execution_timeout" and failed["category"] == "server", failed
        assert answered < EXECUTION_TIMEOUT + 5, answered  # not the 20 s a silent liveness file alone takes
        assert "the worker showed no sign of life since" in timed_pool.log()
        assert "error" not in settle(c, submit(c, "/forward_backward", fb_body(new_model(c), SMALL)))


def test_ops_queued_behind_a_frozen_worker_fail_by_queue_timeout_while_still_queued_wherever_they_wait(
        impatient_pool: LaunchedServer) -> None:
    server = impatient_pool
    r, backlog = server.redis, BacklogKeys(server.keys)
    with server.client("tml-frozen-a") as a, server.client("tml-frozen-b") as b:
        model_a, model_b = new_model(a), new_model(b)
        worker = server.worker_pid()
        os.kill(worker, signal.SIGSTOP)  # idle: all four are queued before it takes any, and it takes them together
        try:
            busy = submit(a, "/forward_backward", fb_body(model_a, BUSY))
            held = [submit(a, "/forward_backward", fb_body(model_a, SMALL)) for _ in range(3)]  # the pool holds 4
        finally:
            os.kill(worker, signal.SIGCONT)
        eventually(lambda: status(server, busy) == "running", 30, "the slow op to begin")
        eventually(lambda: all(rid.encode() in b"".join(r.hvals(UNACKED)) for rid in held), 10,
                   "the pool to hold them")
        os.kill(worker, signal.SIGSTOP)
        assert status(server, busy) == "running" and {status(server, rid) for rid in held} == {"queued"}
        try:
            in_queue = [submit(b, "/forward_backward", fb_body(model_b, SMALL)) for _ in range(2)]  # B's share
            parked = [submit(a, "/forward_backward", fb_body(model_a, SMALL)) for _ in range(2)]  # past A's share
            submitted = time.time()
            queue = b"".join(r.lrange(QUEUE, 0, -1))
            assert all(rid.encode() in queue for rid in in_queue)
            assert all(rid.encode() in b"".join(r.lrange(backlog.parked(QUEUE, a_tenant(server, model_a)), 0, -1))
                       for rid in parked)
            waiting = [*held, *in_queue, *parked]
            outcomes = {rid: settle(a if rid not in in_queue else b, rid, timeout=30) for rid in waiting}
            answered = time.time() - submitted
            assert stopped(worker)  # still frozen: they failed while queued behind it
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        assert {body.get("code") for body in outcomes.values()} == {"queue_timeout"}, outcomes
        assert answered < 3 + 2 + 5, answered  # queue_timeout, the sweep's margin, a round and some slack
        # the worker goes on: its op completes, and the ops it held or still gets are skipped, never run or
        # failed again
        assert "error" not in settle(a, busy)
        assert "error" not in settle(a, submit(a, "/forward_backward", fb_body(model_a, SMALL)))
        assert all(settle(a if rid not in in_queue else b, rid) == body for rid, body in outcomes.items())
        assert "ended while this pool held it" in server.log() and "duplicate delivery" in server.log()


def a_tenant(server: LaunchedServer, model_id: str) -> str:
    owner = server.redis.hget(server.keys.model(model_id), "owner")
    assert owner
    return owner.decode()


async def answers(server: LaunchedServer, key: str, request_ids: list[str]) -> dict[str, tuple[dict[str, Any], float]]:
    """Each future's final answer and when it came, all long-polled at once."""
    limits = httpx.Limits(max_connections=len(request_ids) + 10)
    async with httpx.AsyncClient(base_url=server.api, headers={"X-API-Key": key}, timeout=90, limits=limits) as c:
        async def one(rid: str) -> tuple[dict[str, Any], float]:
            while True:
                body: dict[str, Any] = (await c.post("/retrieve_future", json={"request_id": rid})).json()
                if body.get("type") != "try_again":
                    return body, time.time()

        done = await asyncio.gather(*[one(rid) for rid in request_ids])
    return dict(zip(request_ids, done, strict=True))


def test_hundreds_of_ops_of_an_adapter_queued_behind_a_killed_worker_end_within_seconds_of_its_replacement(
        plain_pool: LaunchedServer) -> None:
    key = "tml-killed-backlog"
    with plain_pool.client(key) as c:
        model = new_model(c)
        worker = plain_pool.worker_pid()
        busy = submit(c, "/forward_backward", fb_body(model, SLOW))
        freeze_once_begun(plain_pool, worker, busy)  # the others queue behind it, however long submitting takes
        behind = [submit(c, "/forward_backward", fb_body(model, SMALL)) for _ in range(300)]
        os.kill(worker, signal.SIGKILL)
        eventually(lambda: plain_pool.worker_pid() != worker, 60, "the replacement worker")
        up = time.time()
        ends = asyncio.run(answers(plain_pool, key, [busy, *behind]))
        codes = Counter(str(body.get("code")) for body, _ in ends.values())
        # A consumer stopped inside BRPOP takes the next message with it (kombu): that one op is lost instead.
        assert set(codes) <= {"adapter_state_lost", "request_lost"} and codes["request_lost"] <= 1, codes
        last = max(answered for _, answered in ends.values()) - up
        assert last < 10, last  # a few seconds, on a loaded machine; one turn per op took minutes
        assert "failed its" in plain_pool.log()  # together, not one turn each
        assert "error" not in settle(c, submit(c, "/forward_backward", fb_body(new_model(c), SMALL)))
