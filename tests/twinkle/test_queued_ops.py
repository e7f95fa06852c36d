"""Queued ops read where the broker holds them (real Celery messages, kombu's unacked hash, a key's backlog) and
failed while still queued, on a redis-server of the test's own (kombu's keys have no prefix)."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import Any

import pytest
import redis

from twinkle import blobs
from twinkle.backlog import BacklogKeys, Parked
from twinkle.celery_app import make_celery, task_name
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX, handover_key
from twinkle.queued_ops import Failure, QueuedOps, created_ms

KEYS = Keys("")
QUEUE = "model.pool.0"


@pytest.fixture
def r(private_client: redis.Redis) -> redis.Redis:
    return private_client


def request_id(age: float = 0.0) -> str:
    """A request id created `age` seconds ago (an id starts with its creation time)."""
    return f"{int((time.time() - age) * 1000):x}-{secrets.token_hex(8)}"


def record(r: redis.Redis, rid: str, *, age: float = 0.0, status: str = FutureStatus.QUEUED, op: str = "forward",
           model_id: str = "m", owner: str = "t", queue: str = QUEUE) -> None:
    rec = FutureRecord(request_id=rid, op=op, owner=owner, model_id=model_id, queue=queue, status=status,
                       created_at=time.time() - age)
    r.hset(KEYS.future(rid), mapping=rec.to_hash())
    r.set(KEYS.blob_in(rid), blobs.dumps({}))


def publish(r: redis.Redis, rid: str, *, queue: str = QUEUE, op: str = "forward", model_id: str = "m") -> None:
    """Send the op's message the way the API does (a real Celery message)."""
    port = r.connection_pool.connection_kwargs["port"]
    make_celery(f"redis://127.0.0.1:{port}/0", events=False).send_task(
        task_name(op), kwargs={"request_id": rid, "model_id": model_id}, queue=queue, task_id=rid)


def hold(r: redis.Redis, rid: str, *, queue: str = QUEUE) -> None:
    """Move the op's message from its queue to kombu's unacked hash, as a worker's delivery does."""
    raw = next(m for m in r.lrange(queue, 0, -1) if rid.encode() in m)
    r.lrem(queue, 1, raw)
    tag = uuid.uuid4().hex
    r.hset(UNACKED, tag, json.dumps([json.loads(raw), "", queue]))
    r.zadd(UNACKED_INDEX, {tag: time.time()})


def park(r: redis.Redis, rid: str, *, tenant: str = "t", op: str = "forward", model_id: str = "m",
         queue: str = QUEUE) -> None:
    r.rpush(BacklogKeys(KEYS).parked(queue, tenant), Parked(rid, op, model_id).encode())
    r.sadd(BacklogKeys(KEYS).waiting(queue), tenant)


def status(r: redis.Redis, rid: str) -> str:
    value: Any = r.hget(KEYS.future(rid), "status")
    return value.decode() if value else ""


def test_ids_are_read_from_the_broker_queue_oldest_first_and_by_creation_time(r: redis.Redis) -> None:
    ids = [request_id(age=100 - i) for i in range(1200)]  # more than one batch
    for rid in ids:
        publish(r, rid)
    ops = QueuedOps(r, KEYS, ttl=60)
    assert [rid for batch in ops.in_queue(QUEUE) for rid in batch] == ids
    fiftieth = created_ms(ids[50]) / 1000
    assert [rid for batch in ops.in_queue(QUEUE, created_before=fiftieth) for rid in batch] == ids[:50]
    assert list(ops.in_queue("model.empty.0")) == []


def test_held_ids_are_those_of_the_queues_asked_for(r: redis.Redis) -> None:
    mine, other, young = request_id(age=30), request_id(age=30), request_id()
    for rid, queue in ((mine, QUEUE), (other, "model.other.0"), (young, QUEUE)):
        publish(r, rid, queue=queue)
        hold(r, rid, queue=queue)
    ops = QueuedOps(r, KEYS, ttl=60)
    assert sorted(ops.held([QUEUE])[QUEUE]) == sorted([mine, young])
    assert ops.held([QUEUE, "model.other.0"], created_before=time.time() - 10) == {
        QUEUE: [mine], "model.other.0": [other]}
    assert ops.held([]) == {}


def test_failing_writes_only_queued_records_old_enough_and_wakes_their_long_polls(r: redis.Redis) -> None:
    queued, young, running, done, other_model = (request_id(age=30) for _ in range(5))
    record(r, queued, age=30, op="forward_backward")
    record(r, young, age=1)
    record(r, running, age=30, status=FutureStatus.RUNNING)
    record(r, done, age=30, status=FutureStatus.COMPLETED)
    record(r, other_model, age=30, model_id="m2")
    pubsub = r.pubsub()
    pubsub.subscribe(KEYS.done_channel(queued))
    pubsub.get_message(timeout=1)  # the subscription's confirmation
    failure = Failure("{op} waited {waited} s; gave up.", "queue_timeout")
    ops = QueuedOps(r, KEYS, ttl=60)
    everything = [queued, young, running, done, other_model, "missing-1"]
    assert ops.fail(everything, failure, created_before=time.time() - 10, model_id="m") == [queued]
    stored = FutureRecord.from_hash(r.hgetall(KEYS.future(queued)))
    assert (stored.status, stored.code, stored.category) == ("failed", "queue_timeout", "server")
    assert stored.error == "forward_backward waited 30 s; gave up." and stored.finished_at > 0
    assert not r.exists(KEYS.blob_in(queued)) and 0 < r.ttl(KEYS.future(queued)) <= 60
    message = pubsub.get_message(timeout=1)
    assert message is not None and message["data"] == b"failed"
    assert [status(r, rid) for rid in (young, running, done, other_model)] == [
        "queued", "running", "completed", "queued"]
    assert not r.exists(KEYS.future("missing-1"))  # never creates a record
    assert ops.fail([queued], failure) == []  # terminal now: left alone
    assert ops.fail([other_model, young], failure) == [other_model, young]  # any time, any model


def test_unparking_takes_out_only_the_given_ops_and_keeps_the_others_in_order(r: redis.Redis) -> None:
    ids = [request_id(age=10) for _ in range(6)]
    for rid in ids:
        park(r, rid)
    parked_key = BacklogKeys(KEYS).parked(QUEUE, "t")
    r.expire(parked_key, 600)
    ops = QueuedOps(r, KEYS, ttl=60)
    assert ops.unpark(QUEUE, "t", [ids[1], ids[4], "not-there"]) == 2
    assert [Parked.decode(raw).request_id for raw in r.lrange(parked_key, 0, -1)] == [ids[0], ids[2], ids[3], ids[5]]
    assert r.ttl(parked_key) > 500
    assert ops.unpark(QUEUE, "t", [ids[0], ids[2], ids[3], ids[5]]) == 4
    assert not r.exists(parked_key) and r.smembers(BacklogKeys(KEYS).waiting(QUEUE)) == set()


def test_a_backlog_is_read_from_its_oldest_end_only_as_far_as_its_ops_are_old_enough(r: redis.Redis) -> None:
    old = [request_id(age=60 - i) for i in range(3)]
    young = [request_id(age=1) for _ in range(2)]
    for rid in [*old, *young]:
        park(r, rid)
    ops = QueuedOps(r, KEYS, ttl=60)
    assert ops.waiting_tenants(QUEUE) == ["t"]
    assert [p.request_id for p in ops.parked(QUEUE, "t", created_before=time.time() - 10)] == old
    assert [p.request_id for p in ops.parked(QUEUE, "t")] == [*old, *young]


def test_a_message_its_consumer_popped_but_did_not_record_yet_is_read_from_the_handover_list(
        r: redis.Redis) -> None:
    popped, waiting = request_id(age=20), request_id(age=10)
    for rid in (popped, waiting):
        publish(r, rid)
    r.lmove(QUEUE, handover_key(QUEUE), "RIGHT", "LEFT")  # what a pool's consumer does first (workers/handover.py)
    assert [rid for batch in QueuedOps(r, KEYS, ttl=60).in_queue(QUEUE) for rid in batch] == [popped, waiting]
