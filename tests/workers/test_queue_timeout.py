"""queue_timeout: an op that waited in its pool's queue longer than the limit fails with a clear code
instead of running late; one within the limit runs."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from twinkle.config.clock import ClockConfig, SchedulingConfig
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.queue_timeouts import queue_timeout_error
from twinkle.queued_ops import Failure, QueuedOps
from workers.runtime import PoolRuntime

ran: list[str] = []


def forward(rec: FutureRecord, _payload: Any) -> dict[str, Any]:
    ran.append(rec.request_id)
    return {"ok": True}


@pytest.fixture
def runtime() -> Iterator[PoolRuntime]:
    require_redis()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    yield PoolRuntime(r, keys, "model.pool.0", {"forward": forward}, future_ttl=60, queue_timeout=5)
    for key in r.scan_iter(match=f"{keys.prefix}*"):
        r.delete(key)
    r.close()


def submitted(runtime: PoolRuntime, request_id: str, waited: float) -> None:
    rec = FutureRecord(request_id=request_id, op="forward", owner="t", model_id="", queue="model.pool.0",
                       created_at=time.time() - waited)
    runtime.r.hset(runtime.keys.future(request_id), mapping=rec.to_hash())


def stored(runtime: PoolRuntime, request_id: str) -> FutureRecord:
    return FutureRecord.from_hash(runtime.r.hgetall(runtime.keys.future(request_id)))


def test_an_op_that_waited_past_queue_timeout_fails_with_its_code_and_never_runs(runtime: PoolRuntime) -> None:
    submitted(runtime, "late", waited=6)
    runtime.execute("forward", "late")
    late = stored(runtime, "late")
    assert late.status == FutureStatus.FAILED and late.code == "queue_timeout" and late.category == "server"
    assert "queue_timeout of 5 s" in late.error and "late" not in ran


def test_an_op_within_queue_timeout_runs(runtime: PoolRuntime) -> None:
    submitted(runtime, "prompt", waited=1)
    runtime.execute("forward", "prompt")
    assert stored(runtime, "prompt").status == FutureStatus.COMPLETED and "prompt" in ran


def test_a_zero_queue_timeout_waits_forever(runtime: PoolRuntime) -> None:
    runtime.queue_timeout = 0
    submitted(runtime, "patient", waited=86400)
    runtime.execute("forward", "patient")
    assert stored(runtime, "patient").status == FutureStatus.COMPLETED


def test_an_op_the_sweep_failed_while_the_pool_held_it_is_skipped_at_its_turn_not_failed_again(
        runtime: PoolRuntime) -> None:
    runtime.queue_timeout = 1
    runtime.use_clock(None, ClockConfig(), SchedulingConfig())  # fair share: ops wait for their turn in the pool
    release = threading.Event()
    runtime.handlers["slow"] = lambda rec, _payload: release.wait(10) and {"ok": True}
    for rid, op in (("busy", "slow"), ("held", "forward")):
        submitted(runtime, rid, waited=0.5)
        runtime.r.hset(runtime.keys.future(rid), "op", op)
    threads = [threading.Thread(target=runtime.execute, args=(op, rid)) for rid, op in (("busy", "slow"),
                                                                                         ("held", "forward"))]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # `busy` runs, `held` waits for its turn
    time.sleep(1)  # `held` is past its queue_timeout now: the API's sweep fails it while still queued
    error = queue_timeout_error("{op}", "{waited}", runtime.queue, 1)
    assert QueuedOps(runtime.r, runtime.keys, ttl=60).fail(["held"], Failure(str(error), error.code)) == ["held"]
    swept = stored(runtime, "held")
    release.set()
    for thread in threads:
        thread.join(10)
    assert stored(runtime, "busy").status == FutureStatus.COMPLETED
    assert stored(runtime, "held") == swept and "held" not in ran  # neither run nor failed again
