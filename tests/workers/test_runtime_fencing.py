"""A pool worker whose queue's lease another worker took writes no outcome: the runtime's scripts that begin and
finish an op check the lease's fence token in the same script as their write (twinkle/pool_lease.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from twinkle.errors import OpTimedOut
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.pool_lease import PoolLease
from workers.runtime import PoolRuntime

QUEUE = "model.pool.0"


class Fenced:
    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.lost: list[str] = []
        self.lease = PoolLease(r, keys, QUEUE, 30, on_lost=self.lost.append)
        self.lease.acquire()
        self.ran: list[str] = []
        self.during: Callable[[], None] = lambda: None
        self.runtime = PoolRuntime(r, keys, QUEUE, {"forward": self.forward, "crash": self.crash}, future_ttl=60,
                                   lease=self.lease)

    def forward(self, rec: FutureRecord, _payload: Any) -> dict[str, Any]:
        self.ran.append(rec.request_id)
        self.during()
        return {"ok": True}

    def crash(self, rec: FutureRecord, _payload: Any) -> None:
        self.during()
        raise RuntimeError("the backend fell over")

    def submit(self, request_id: str, op: str = "forward") -> None:
        rec = FutureRecord(request_id=request_id, op=op, owner="t", model_id="", queue=QUEUE, created_at=time.time())
        self.r.hset(self.keys.future(request_id), mapping=rec.to_hash())

    def stored(self, request_id: str) -> FutureRecord:
        return FutureRecord.from_hash(self.r.hgetall(self.keys.future(request_id)))

    def take_over(self) -> PoolLease:
        """Another worker takes the queue after this one's lease lapsed (it was frozen)."""
        self.r.delete(self.keys.pool_lease(QUEUE))
        successor = PoolLease(self.r, self.keys, QUEUE, 30, on_lost=self.lost.append)
        successor.acquire()
        return successor


@pytest.fixture
def pool(redis_keys: tuple[redis.Redis, Keys]) -> Iterator[Fenced]:
    yield Fenced(*redis_keys)


def test_an_op_of_the_holder_runs_and_completes(pool: Fenced) -> None:
    pool.submit("mine")
    pool.runtime.execute("forward", "mine")
    assert pool.stored("mine").status == FutureStatus.COMPLETED and pool.lost == []


def test_a_fenced_off_worker_does_not_begin_an_op(pool: Fenced) -> None:
    pool.submit("taken")
    pool.take_over()
    pool.runtime.execute("forward", "taken")
    assert pool.ran == [] and pool.stored("taken").status == FutureStatus.QUEUED
    assert len(pool.lost) == 1 and "another worker took over" in pool.lost[0]


def test_an_op_whose_worker_was_replaced_while_it_ran_has_no_outcome_written(pool: Fenced) -> None:
    pool.submit("in-flight")
    pool.during = pool.take_over  # frozen mid-op past the lease; the successor took the queue
    pool.runtime.execute("forward", "in-flight")
    stored = pool.stored("in-flight")
    assert pool.ran == ["in-flight"] and stored.status == FutureStatus.RUNNING  # as the successor will find it
    assert not pool.r.exists(pool.keys.blob_out("in-flight")) and len(pool.lost) == 1


def test_a_fenced_off_worker_writes_no_failure_either(pool: Fenced) -> None:
    pool.submit("crashing", op="crash")
    pool.during = pool.take_over
    pool.runtime.execute("crash", "crashing")
    assert pool.stored("crashing").status == FutureStatus.RUNNING and pool.lost


def test_the_hang_watchdog_of_a_fenced_off_worker_fails_nothing(pool: Fenced) -> None:
    pool.submit("hung")
    abandoned: list[FutureRecord | None] = []

    def hang_and_be_abandoned() -> None:
        pool.take_over()
        abandoned.append(pool.runtime.abandon_current(OpTimedOut("ran past its execution_timeout")))

    pool.during = hang_and_be_abandoned
    pool.runtime.execute("forward", "hung")
    assert abandoned and abandoned[0] is not None
    assert pool.stored("hung").status == FutureStatus.RUNNING and pool.lost


def test_a_worker_whose_lease_the_broker_lost_keeps_writing(pool: Fenced) -> None:
    pool.r.delete(pool.keys.pool_lease(QUEUE), pool.keys.pool_lease_fence(QUEUE))  # restarted, no persistence
    pool.submit("after-restart")
    pool.runtime.execute("forward", "after-restart")
    assert pool.stored("after-restart").status == FutureStatus.COMPLETED and pool.lost == []
