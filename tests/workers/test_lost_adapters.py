"""A restarted pool that finds an adapter lost fails that adapter's waiting ops together (in the broker queue,
held, parked), up to the op that brings it back; their later deliveries are skipped without running. Real Redis
of the test's own (kombu's keys have no prefix), a real PoolRuntime; the backend is a stand-in that holds every
adapter but the lost one."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tests.twinkle.test_queued_ops import KEYS, QUEUE, hold, park, publish, record, request_id, status
from twinkle.backlog import BacklogKeys, BacklogRelease
from twinkle.errors import lost_state_error
from twinkle.futures import FutureRecord, Op
from twinkle.queued_ops import WAKE_BATCH, QueuedOps
from twinkle.records import ModelRecord
from workers.lost_adapters import LostAdapterOps
from workers.runtime import PoolRuntime

CHECKPOINT = "tinker://run-lost/weights/step-7"


@pytest.fixture
def r(private_client: redis.Redis) -> redis.Redis:
    return private_client


class Pool:
    """A pool runtime whose handlers record what ran."""

    def __init__(self, r: redis.Redis) -> None:
        self.ran: list[str] = []
        handlers = {op.value: self.handler for op in Op}
        self.runtime = PoolRuntime(r, KEYS, QUEUE, handlers, future_ttl=600, has_adapter=lambda m: m != "lost")
        self.runtime.backlog = BacklogRelease(r, KEYS, QUEUE, window=8, ttl=600)
        self.sent: list[str] = []
        self.runtime.send = lambda parked: self.sent.append(parked.request_id)

    def handler(self, rec: FutureRecord, _args: Any) -> dict[str, Any]:
        self.ran.append(rec.request_id)
        return {}


def model(r: redis.Redis, model_id: str) -> None:
    r.hset(KEYS.model(model_id), mapping=ModelRecord(model_id=model_id, owner="t", session_id="s", base_model="b",
                                                     app="a", queue=QUEUE, last_checkpoint=CHECKPOINT).to_hash())


def op(r: redis.Redis, where: str, age: float, *, kind: str = "forward", model_id: str = "lost") -> str:
    rid = request_id(age)
    record(r, rid, age=age, op=kind, model_id=model_id)
    if where == "parked":
        park(r, rid, op=kind, model_id=model_id)
    else:
        publish(r, rid, op=kind, model_id=model_id)
        if where == "held":
            hold(r, rid)
    return rid


def test_the_first_op_found_lost_fails_its_adapters_waiting_ops_together_up_to_its_load_state(
        r: redis.Redis) -> None:
    model(r, "lost")
    model(r, "alive")
    first = op(r, "held", 20)
    doomed = [op(r, "queue", 19), op(r, "held", 18), op(r, "parked", 17), op(r, "queue", 16, kind="optim_step")]
    sample = op(r, "queue", 15, kind="sample")  # never needed the adapter
    load = op(r, "queue", 14, kind="load_state")  # brings the adapter back: what follows may succeed
    after_load = [op(r, "queue", 13), op(r, "parked", 12)]
    other = op(r, "queue", 19, model_id="alive")
    pool = Pool(r)
    pool.runtime.execute("forward", first)
    for rid in [first, *doomed]:
        failed = FutureRecord.from_hash(r.hgetall(KEYS.future(rid)))
        assert (failed.status, failed.code) == ("failed", "adapter_state_lost"), rid
        assert CHECKPOINT in failed.error
    assert [status(r, rid) for rid in (sample, load, *after_load, other)] == ["queued"] * 5
    # the failed parked op left the backlog without being sent; the one after the load_state is sent as its turn
    # comes (here at once: the key has nothing else in the queue)
    assert pool.sent == [after_load[1]] and not r.exists(BacklogKeys(KEYS).parked(QUEUE, "t"))
    assert pool.ran == []


def test_a_failed_ops_later_delivery_is_skipped_and_lets_its_keys_next_parked_op_in(r: redis.Redis) -> None:
    model(r, "lost")
    first, second = op(r, "held", 20), op(r, "queue", 19)
    parked = [op(r, "parked", 18 - i, model_id="alive") for i in range(2)]
    model(r, "alive")
    backlog = BacklogKeys(KEYS)
    r.zadd(backlog.sent(QUEUE, "t"), {rid: 1 for rid in [first, second, *(f"busy-{i}" for i in range(6))]})
    pool = Pool(r)
    pool.runtime.execute("forward", first)  # fails `second` with it; `first` ending lets one parked op in
    assert status(r, second) == "failed" and pool.sent == [parked[0]]
    pool.runtime.execute("forward", second)  # its message arrives: no turn, no outcome rewritten
    assert status(r, second) == "failed" and pool.ran == []
    assert pool.sent == parked  # it no longer counts as the key's op in the queue
    assert second.encode() not in r.zrange(backlog.sent(QUEUE, "t"), 0, -1)


def test_past_the_first_batch_the_waiting_ops_fail_paced_on_a_thread_of_their_own(r: redis.Redis) -> None:
    waiting = [op(r, "parked", 300 - i * 0.01) for i in range(WAKE_BATCH * 2 + 50)]
    lost = LostAdapterOps(QueuedOps(r, KEYS, ttl=600), QUEUE)
    assert lost.fail_waiting("lost", "t", lost_state_error("lost", CHECKPOINT)) == len(waiting)
    assert [status(r, rid) for rid in waiting[:WAKE_BATCH]] == ["failed"] * WAKE_BATCH  # the oldest: at once
    assert lost.rest is not None
    lost.rest.join(10)
    assert {status(r, rid) for rid in waiting} == {"failed"}
    assert not r.exists(BacklogKeys(KEYS).parked(QUEUE, "t"))
