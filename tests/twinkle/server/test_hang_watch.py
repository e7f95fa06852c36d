"""The launcher's outside watch: which liveness a hung worker shows, and failing the op it was running."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from tests.private_redis import PrivateRedis
from twinkle import liveness
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED
from twinkle.liveness import Liveness
from twinkle.server.hang_watch import HangWatch

NOW = 1_000_000.0


@pytest.fixture
def watch() -> Iterator[HangWatch]:
    require_redis()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    yield HangWatch(r, keys, stall_seconds=20, grace_seconds=3)
    for key in r.scan_iter(match=f"{keys.prefix}*"):
        r.delete(key)
    r.close()


def test_a_live_worker_is_not_hung_idle_or_inside_its_time_limit(watch: HangWatch) -> None:
    assert watch.verdict(Liveness(pid=1, t=NOW - 1), NOW) == ""
    busy = Liveness(pid=1, t=NOW - 1, current="r1", op="forward", started=NOW - 11, execution_timeout=10)
    assert watch.verdict(busy, NOW) == ""  # past the limit, but its own watchdog still has the grace to act
    unlimited = Liveness(pid=1, t=NOW - 1, current="r1", op="forward", started=NOW - 3600)
    assert watch.verdict(unlimited, NOW) == ""


def test_an_op_past_its_limit_and_grace_or_a_silent_worker_is_hung(watch: HangWatch) -> None:
    stuck = Liveness(pid=1, t=NOW, current="r1", op="forward", started=NOW - 14, execution_timeout=10)
    assert "past this pool's execution_timeout of 10 s" in watch.verdict(stuck, NOW)
    frozen = Liveness(pid=1, t=NOW - 21)
    assert "no sign of life for 21 s" in watch.verdict(frozen, NOW)


def test_failing_the_hung_op_marks_it_timed_out_once_and_never_overwrites_an_outcome(watch: HangWatch) -> None:
    rec = FutureRecord(request_id="r1", op="forward", owner="t", model_id="m", queue="q", status=FutureStatus.RUNNING)
    watch.r.hset(watch.keys.future("r1"), mapping=rec.to_hash())
    beat = Liveness(pid=1, t=NOW - 30, current="r1", op="forward", started=NOW - 30)
    assert watch.fail_current(beat, "it showed no sign of life for 30 s")
    stored = FutureRecord.from_hash(watch.r.hgetall(watch.keys.future("r1")))
    assert stored.status == FutureStatus.FAILED and stored.code == "execution_timeout" and stored.category == "server"
    assert "worker hung (it showed no sign of life for 30 s)" in stored.error
    assert not watch.fail_current(beat, "again")  # terminal: left alone
    assert not watch.fail_current(Liveness(pid=1, t=NOW, current="missing"), "x")  # never creates a record
    assert not watch.r.exists(watch.keys.future("missing"))


def test_the_liveness_file_round_trips_and_a_torn_or_missing_one_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    assert liveness.read(path) is None
    beat = Liveness(pid=7, t=time.time(), current="r1", op="forward", started=1.0, execution_timeout=5)
    liveness.write(path, beat)
    assert liveness.read(path) == beat
    path.write_text("{")
    assert liveness.read(path) is None


def test_a_worker_that_froze_before_naming_its_op_still_gets_its_running_op_failed(tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)  # kombu's unacked hash has no prefix: never the shared Redis
    broker.start()
    r = redis.Redis(port=broker.port)
    try:
        watch = HangWatch(r, Keys(""))
        for rid, status, queue in (("run", "running", "model.a.0"), ("wait", "queued", "model.a.0"),
                                   ("other", "running", "model.b.0")):
            r.hset(watch.keys.future(rid), mapping={"status": status})
            r.hset(UNACKED, f"tag-{rid}", json.dumps([{"headers": {"id": rid}}, "", queue]))
        assert watch.fail_current(Liveness(pid=1, t=NOW - 30), "it showed no sign of life for 30 s", "model.a.0") == 1
        assert [r.hget(watch.keys.future(rid), "status") for rid in ("run", "wait", "other")] == [
            b"failed", b"queued", b"running"]
    finally:
        r.close()
        broker.kill()


def test_a_worker_frozen_before_its_liveness_named_the_new_op_gets_that_op_failed_not_only_the_named_one(
        tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    r = redis.Redis(port=broker.port)
    try:
        watch = HangWatch(r, Keys(""))
        r.hset(watch.keys.future("before"), mapping={"status": "completed"})  # what the stale file names
        r.hset(watch.keys.future("frozen-in"), mapping={"status": "running"})
        r.hset(UNACKED, "tag-frozen-in", json.dumps([{"headers": {"id": "frozen-in"}}, "", "model.a.0"]))
        stale = Liveness(pid=1, t=NOW, current="before", op="forward_backward", started=NOW - 14,
                         execution_timeout=10)
        assert watch.fail_current(stale, "forward_backward ran 14 s", "model.a.0") == 1
        assert r.hget(watch.keys.future("frozen-in"), "code") == b"execution_timeout"
        assert r.hget(watch.keys.future("before"), "status") == b"completed"  # its outcome stands
    finally:
        r.close()
        broker.kill()


def test_a_worker_frozen_right_after_it_began_an_op_is_hung_by_the_ops_record_past_its_limit(
        tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)  # kombu's unacked hash has no prefix: never the shared Redis
    broker.start()
    r = redis.Redis(port=broker.port)
    try:
        watch = HangWatch(r, Keys(""), record_check_seconds=0)
        r.hset(watch.keys.future("r1"), mapping={"status": "running", "started_at": NOW - 14, "op": "forward"})
        r.hset(UNACKED, "tag-r1", json.dumps([{"headers": {"id": "r1"}}, "", "model.a.0"]))
        # written just before the op began (it names the op before, or none), then nothing: the process is stopped
        stale = Liveness(pid=1, t=NOW - 14.5, current="", execution_timeout=10)
        why = watch.verdict(stale, NOW, queue="model.a.0", since=NOW - 100)
        assert why == ("forward r1 began 14 s ago, past this pool's execution_timeout of 10 s, and the worker "
                       "showed no sign of life since")
        assert watch.verdict(stale, NOW) == ""  # from the file alone: only the stall limit, 20 s
        assert watch.fail_current(stale, why, "model.a.0") == 1
        assert r.hget(watch.keys.future("r1"), "code") == b"execution_timeout"
    finally:
        r.close()
        broker.kill()


def test_a_live_worker_or_an_op_it_did_not_begin_is_not_hung_by_a_record(tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    r = redis.Redis(port=broker.port)
    try:
        watch = HangWatch(r, Keys(""), record_check_seconds=0)
        for queue in ("model.a.0", "sampler.s"):
            r.hset(watch.keys.future(queue), mapping={"status": "running", "started_at": NOW - 14, "op": "forward"})
            r.hset(UNACKED, f"tag-{queue}", json.dumps([{"headers": {"id": queue}}, "", queue]))
        silent = Liveness(pid=1, t=NOW - 14.5, execution_timeout=10)
        assert watch.verdict(silent, NOW, queue="model.a.0", since=NOW - 100)  # the case above
        # it wrote its file since the op was due to end: alive (the op's outcome is on its way)
        assert watch.verdict(Liveness(pid=1, t=NOW - 3.5, execution_timeout=10), NOW, queue="model.a.0",
                             since=NOW - 100) == ""
        # within its limit and grace
        assert watch.verdict(silent, NOW - 2, queue="model.a.0", since=NOW - 100) == ""
        # begun by the worker this one replaced: its redelivery fails it as lost
        assert watch.verdict(silent, NOW, queue="model.a.0", since=NOW - 10) == ""
        # a sampler pool runs ops side by side with no limit of its own
        assert watch.verdict(silent, NOW, queue="sampler.s", since=NOW - 100) == ""
        # a pool without an execution_timeout
        assert watch.verdict(Liveness(pid=1, t=NOW - 14.5), NOW, queue="model.a.0", since=NOW - 100) == ""
        r.hset(watch.keys.future("model.a.0"), "status", "completed")
        assert watch.verdict(silent, NOW, queue="model.a.0", since=NOW - 100) == ""
        broker.kill()  # no records to read: no verdict from them (the file's stall limit still applies)
        assert watch.verdict(silent, NOW, queue="model.a.0", since=NOW - 100) == ""
    finally:
        r.close()
        broker.kill()


def test_a_hung_worker_whose_lease_another_worker_took_fails_only_its_own_op_not_the_new_holders(
        tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    r = redis.Redis(port=broker.port)
    try:
        watch = HangWatch(r, Keys(""))
        r.hset(watch.keys.future("its-own"), mapping={"status": "running"})
        r.hset(watch.keys.future("successors"), mapping={"status": "running"})
        r.hset(UNACKED, "tag-s", json.dumps([{"headers": {"id": "successors"}}, "", "model.a.0"]))
        r.hset(watch.keys.pool_lease("model.a.0"), mapping={"host": "node-b", "pid": 4242, "token": "t2"})
        frozen = Liveness(pid=1, t=NOW - 30, current="its-own", op="forward")
        assert watch.fail_current(frozen, "it showed no sign of life for 30 s", "model.a.0") == 1
        assert r.hget(watch.keys.future("its-own"), "code") == b"execution_timeout"
        assert r.hget(watch.keys.future("successors"), "status") == b"running"  # the new holder's op runs on
    finally:
        r.close()
        broker.kill()
