"""What a pool writes once an op ran goes in one round trip: the outcome and the ack of its message, the key's
backlog release, the run's metrics and the usage. Metrics count only an outcome this worker wrote; a worker fenced
off its queue writes nothing, leaves its message to the consumer's own ack and what the release would have sent
parked, for the queue's new holder."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.harness import redis_sends
from twinkle.backlog import ADMIT, MIN_SHARE, BacklogKeys, BacklogRelease, Parked
from twinkle.futures import FutureRecord, FutureStatus, Op
from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX
from twinkle.pool_lease import PoolLease
from twinkle.records import ModelRecord
from twinkle.run_metrics import parse_entry
from twinkle.usage import UsageLedger
from workers.runtime import PoolRuntime

QUEUE = "model.pool.0"
MODEL = "s1:train:0"


class Pool:
    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.lost: list[str] = []
        self.lease = PoolLease(r, keys, QUEUE, 30, on_lost=self.lost.append)
        self.lease.acquire()
        self.sent: list[str] = []
        self.during = lambda: None
        self.runtime = PoolRuntime(r, keys, QUEUE, {Op.OPTIM_STEP: self.optim_step}, future_ttl=60,
                                   lease=self.lease)
        self.runtime.backlog = BacklogRelease(r, keys, QUEUE, window=2, ttl=60)
        self.runtime.send = lambda parked: self.sent.append(parked.request_id)
        self.runtime.ledger = UsageLedger(r, keys)
        self.acked: set[str] = set()
        self.runtime.acked_by_finish = self.acked  # as a pool worker's handover consumer has it
        self.runtime.usage_model = "tiny"
        r.hset(keys.model(MODEL), mapping=ModelRecord(MODEL, "t", "s1", "tiny", "app", QUEUE).to_hash())

    def optim_step(self, rec: FutureRecord, _payload: Any) -> dict[str, Any]:
        self.during()
        return {"metrics": {"grad_norm:mean": 0.5}}

    def submit(self, request_id: str) -> bool:
        """Accept an op as the API does: its record, then its key's admission (False: parked in the backlog)."""
        rec = FutureRecord(request_id=request_id, op=Op.OPTIM_STEP, owner="t", model_id=MODEL, queue=QUEUE,
                           created_at=time.time())
        self.r.hset(self.keys.future(request_id), mapping=rec.to_hash())
        admitted = self.r.register_script(ADMIT)(keys=BacklogKeys(self.keys).of(QUEUE, "t"), args=[
            "t", request_id, Op.OPTIM_STEP, MODEL, 2, MIN_SHARE, 60, time.time()])
        return bool(int(admitted))

    def parked(self) -> list[str]:
        return [Parked.decode(raw).request_id
                for raw in self.r.lrange(BacklogKeys(self.keys).parked(QUEUE, "t"), 0, -1)]

    def delivered(self) -> str:
        """A delivery tag with its unacked entry, as the pool's consumer records a message it took."""
        tag = f"test-{uuid.uuid4().hex}"
        self.r.hset(UNACKED, tag, f'[{{"body": "{tag}"}}, "", "{QUEUE}"]')
        self.r.zadd(UNACKED_INDEX, {tag: time.time()})
        return tag

    def unacked(self, tag: str) -> bool:
        return bool(self.r.hexists(UNACKED, tag)) or self.r.zscore(UNACKED_INDEX, tag) is not None

    def steps(self) -> list[int]:
        return [parse_entry(raw)["step"] for raw in self.r.lrange(self.keys.run_metrics(MODEL), 0, -1)]


@pytest.fixture
def pool(redis_keys: tuple[redis.Redis, Keys]) -> Iterator[Pool]:
    yield Pool(*redis_keys)


def test_the_outcome_ack_release_metrics_and_usage_of_an_op_take_one_round_trip(pool: Pool) -> None:
    assert pool.submit("warm")  # a broker that never ran the scripts loads them on first use: a round trip each
    pool.runtime.execute(Op.OPTIM_STEP, "warm", MODEL, delivery_tag=pool.delivered())
    pool.acked.clear()
    assert pool.submit("op0")
    tag = pool.delivered()
    after_handler: list[int] = []
    with redis_sends() as sends:
        pool.during = lambda: after_handler.append(len(sends))
        pool.runtime.execute(Op.OPTIM_STEP, "op0", MODEL, delivery_tag=tag)

    assert len(sends) - after_handler[0] == 1
    assert not pool.unacked(tag) and pool.acked == {tag}  # acknowledged by the finish, and the consumer told so
    assert FutureRecord.from_hash(pool.r.hgetall(pool.keys.future("op0"))).state is FutureStatus.COMPLETED
    assert pool.steps() == [1, 2]
    assert UsageLedger(pool.r, pool.keys).totals("t", "day")  # the op's usage was counted
    assert pool.r.zcard(BacklogKeys(pool.keys).sent(QUEUE, "t")) == 0  # and its key's count released


def test_a_finished_op_sends_its_keys_next_parked_op(pool: Pool) -> None:
    assert [pool.submit(f"op{i}") for i in range(3)] == [True, True, False]  # a share of 2: the third is parked
    pool.runtime.execute(Op.OPTIM_STEP, "op0", MODEL)
    assert pool.sent == ["op2"] and pool.parked() == []


def test_a_worker_fenced_off_while_an_op_ran_leaves_the_release_parked_and_counts_no_metrics(pool: Pool) -> None:
    assert [pool.submit(f"op{i}") for i in range(3)] == [True, True, False]

    def take_over() -> None:
        pool.r.delete(pool.keys.pool_lease(QUEUE))
        PoolLease(pool.r, pool.keys, QUEUE, 30, on_lost=pool.lost.append).acquire()

    pool.during = take_over
    tag = pool.delivered()
    pool.runtime.execute(Op.OPTIM_STEP, "op0", MODEL, delivery_tag=tag)

    assert FutureRecord.from_hash(pool.r.hgetall(pool.keys.future("op0"))).state is FutureStatus.RUNNING
    assert pool.unacked(tag) and tag not in pool.acked  # the message is the consumer's to ack
    pool.r.hdel(UNACKED, tag)
    pool.r.zrem(UNACKED_INDEX, tag)
    assert pool.sent == [] and pool.parked() == ["op2"]  # for the queue's new holder to send
    assert pool.steps() == [] and len(pool.lost) == 1


def test_an_op_whose_record_vanished_leaves_its_message_to_the_consumers_own_ack(pool: Pool) -> None:
    assert pool.submit("op0")
    tag = pool.delivered()
    def vanish() -> None:  # what a broker restarted without persistence does to the record
        pool.r.delete(pool.keys.future("op0"))

    pool.during = vanish
    pool.runtime.execute(Op.OPTIM_STEP, "op0", MODEL, delivery_tag=tag)

    assert pool.unacked(tag) and tag not in pool.acked
    pool.r.hdel(UNACKED, tag)
    pool.r.zrem(UNACKED_INDEX, tag)
