"""The hang watchdog: an op past execution_timeout fails its future, then the worker exits for a restart."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.pool_exit import PoolExit, exit_reason
from workers import watchdog
from workers.runtime import PoolRuntime, RunningOp
from workers.watchdog import Watchdog


@pytest.fixture
def runtime() -> Iterator[PoolRuntime]:
    require_redis()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    yield PoolRuntime(r, keys, "model.pool.0", {}, future_ttl=60)
    for key in r.scan_iter(match=f"{keys.prefix}*"):
        r.delete(key)
    r.close()


def test_only_an_op_running_longer_than_the_timeout_is_overdue(runtime: PoolRuntime) -> None:
    dog = Watchdog(runtime, timeout=2)
    assert not dog.overdue()
    rec = FutureRecord(request_id="r1", op="forward_backward", owner="t", model_id="m", queue="model.pool.0")
    runtime.current = RunningOp(rec, time.monotonic() - 1)
    assert not dog.overdue()
    runtime.current = RunningOp(rec, time.monotonic() - 3)
    assert dog.overdue()


def test_expiry_fails_the_running_future_then_exits_with_the_hung_code(
        runtime: PoolRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = FutureRecord(request_id="r2", op="forward_backward", owner="t", model_id="m", queue="model.pool.0",
                       status=FutureStatus.RUNNING)
    runtime.r.hset(runtime.keys.future(rec.request_id), mapping=rec.to_hash())
    runtime.current = RunningOp(rec, time.monotonic() - 10)

    def fake_exit(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(watchdog.os, "_exit", fake_exit)
    monkeypatch.setattr(watchdog.logging, "shutdown", lambda: None)  # pytest's log capture stays open
    with pytest.raises(SystemExit) as exited:
        Watchdog(runtime, timeout=5).expire()
    assert exited.value.code == PoolExit.HUNG
    stored = FutureRecord.from_hash(runtime.r.hgetall(runtime.keys.future(rec.request_id)))
    assert stored.status == FutureStatus.FAILED and "execution_timeout of 5 s" in stored.error
    assert exit_reason(PoolExit.HUNG) == "an op ran past its execution_timeout" and exit_reason(1) == ""
