"""The ledger's state machine holds the same on both faces: every case runs once on the sync face (through a
thread) and once on the async face, against a real Redis. Keyed cases use the tests' shared Redis under a prefix of
their own; kombu's unacked keys have no prefix, so those cases use a redis-server of the module's own."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pytest
import redis
import redis.asyncio as aioredis

from twinkle.backlog import BacklogKeys, Parked
from twinkle.futures import FutureRecord, FutureStatus, new_request_id
from twinkle.keys import Keys
from twinkle.ledger import AsyncLedger, SyncLedger, lifecycle, messages, queued, saves
from twinkle.ledger.call import Call
from twinkle.ledger.lifecycle import Refused
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX, handover_key
from twinkle.records import ModelRecord

T = TypeVar("T")
TTL = 60


class Runner(Protocol):
    def __call__(self, call: Call[T]) -> Awaitable[T]: ...


@dataclass
class Face:
    run: Runner  # the face under test, made awaitable
    r: redis.Redis  # a plain client of the same database, to arrange and inspect
    keys: Keys

    @property
    def queue(self) -> str:
        return f"{self.keys.root}model.pool.0"  # under the prefix: removed with the test's keys

    def record(self, *, status: str = FutureStatus.QUEUED, model_id: str = "m", owner: str = "alice",
               run_id: str = "", age: float = 0.0) -> FutureRecord:
        return FutureRecord(request_id=new_request_id(), op="forward", owner=owner, model_id=model_id,
                            queue=self.queue, status=status, broker_run_id=run_id, created_at=time.time() - age)

    def store(self, record: FutureRecord) -> FutureRecord:
        self.r.hset(self.keys.future(record.request_id), mapping=record.to_hash())
        self.r.set(self.keys.blob_in(record.request_id), b"payload")
        return record

    def model(self, model_id: str = "m") -> None:
        self.r.hset(self.keys.model(model_id), mapping=ModelRecord(
            model_id=model_id, owner="alice", session_id="s", base_model="b", app="pool", queue=self.queue).to_hash())

    def status(self, request_id: str) -> str:
        value: Any = self.r.hget(self.keys.future(request_id), "status")
        return value.decode() if value else ""


@asynccontextmanager
async def face_on(kind: str, r: redis.Redis, keys: Keys) -> AsyncIterator[Face]:
    if kind == "sync":
        ledger = SyncLedger(r)

        async def run(call: Call[T]) -> T:
            return await asyncio.to_thread(ledger.run, call)

        yield Face(run, r, keys)
        return
    where = r.connection_pool.connection_kwargs
    client = aioredis.Redis(host=where.get("host", "127.0.0.1"), port=where["port"], db=where.get("db", 0))
    try:
        yield Face(AsyncLedger(client).run, r, keys)
    finally:
        await client.aclose()


@pytest.fixture(params=["sync", "async"])
async def face(request: pytest.FixtureRequest, redis_keys: tuple[redis.Redis, Keys]) -> AsyncIterator[Face]:
    async with face_on(request.param, *redis_keys) as on:
        yield on


@pytest.fixture(params=["sync", "async"])
async def broker_face(request: pytest.FixtureRequest, private_client: redis.Redis) -> AsyncIterator[Face]:
    async with face_on(request.param, private_client, Keys("")) as on:
        yield on


# -- submit ---------------------------------------------------------------------------------------------------


async def test_a_submit_stores_a_queued_record_its_payload_and_a_ticket(face: Face) -> None:
    face.model()
    record = face.record()
    rid = record.request_id
    assert await face.run(lifecycle.submit(face.keys, record, b"in", dedupe_key="", ttl=TTL)) == rid
    stored = await face.run(lifecycle.read(face.keys, rid))
    assert stored is not None and stored.state is FutureStatus.QUEUED and stored.ticket == 1
    assert face.r.get(face.keys.blob_in(rid)) == b"in" and 0 < face.r.ttl(face.keys.future(rid)) <= TTL
    assert face.r.zscore(face.keys.owner_futures("alice"), rid) is not None
    assert face.r.hget(face.keys.model("m"), "last_request_at") is not None


async def test_a_retried_submit_answers_the_first_ones_request_id_and_the_same_one_sent_twice_counts_once(
        face: Face) -> None:
    dedupe = face.keys.dedupe("m", 7)
    first, retry = face.record(), face.record()
    assert await face.run(lifecycle.submit(face.keys, first, b"", dedupe_key=dedupe, ttl=TTL)) == first.request_id
    assert await face.run(lifecycle.submit(face.keys, retry, b"", dedupe_key=dedupe, ttl=TTL)) == first.request_id
    assert not face.r.exists(face.keys.future(retry.request_id))
    assert await face.run(lifecycle.submit(face.keys, first, b"", dedupe_key=dedupe, ttl=TTL)) == first.request_id
    assert face.r.get(face.keys.queue_tickets(face.queue)) == b"1"


async def test_a_submit_and_send_pushes_each_message_once_and_parks_what_exceeds_the_keys_share(face: Face) -> None:
    backlog = BacklogKeys(face.keys)
    records = [face.record() for _ in range(3)]

    def sending(record: FutureRecord) -> Call[str]:
        return lifecycle.submit_and_send(face.keys, record, b"", dedupe_key="", ttl=TTL,
                                         backlog=backlog.of(face.queue, "alice"), window=2,
                                         message=json.dumps({"headers": {"id": record.request_id}}))

    for record in records:
        assert await face.run(sending(record)) == record.request_id
    assert await face.run(sending(records[0])) == records[0].request_id  # sent again: nothing more
    pushed = [json.loads(m)["headers"]["id"] for m in reversed(face.r.lrange(face.queue, 0, -1))]
    assert pushed == [r.request_id for r in records[:2]]
    [parked] = face.r.lrange(backlog.parked(face.queue, "alice"), 0, -1)
    assert Parked.decode(parked).request_id == records[2].request_id


@pytest.mark.parametrize("send", [False, True])
async def test_a_submit_that_checks_its_model_stores_nothing_unless_it_is_the_owners_active_one(
        face: Face, send: bool) -> None:
    backlog = BacklogKeys(face.keys)

    def submitting(record: FutureRecord) -> Call[str]:
        if send:
            return lifecycle.submit_and_send(face.keys, record, b"", dedupe_key="", ttl=TTL,
                                             backlog=backlog.of(face.queue, record.owner), window=2,
                                             message="{}", check_model=True)
        return lifecycle.submit(face.keys, record, b"", dedupe_key="", ttl=TTL, check_model=True)

    missing = face.record(model_id="absent")
    assert await face.run(submitting(missing)) == lifecycle.MODEL_MISSING
    face.model()
    others = face.record(owner="mallory")
    assert await face.run(submitting(others)) == lifecycle.MODEL_MISSING
    active = face.record()
    assert await face.run(submitting(active)) == active.request_id
    face.r.hset(face.keys.model("m"), "status", "unloaded")
    unloaded = face.record()
    assert await face.run(submitting(unloaded)) == lifecycle.MODEL_UNLOADED
    for refused in (missing, others, unloaded):
        assert not face.r.exists(face.keys.future(refused.request_id), face.keys.blob_in(refused.request_id))
    assert face.r.get(face.keys.queue_tickets(face.queue)) == b"1"
    assert face.r.llen(face.queue) == (1 if send else 0)


async def test_a_withdrawn_submit_leaves_no_record_payload_place_or_dedupe(face: Face) -> None:
    record, dedupe = face.record(), face.keys.dedupe("m", 1)
    sent = BacklogKeys(face.keys).sent(face.queue, "alice")
    await face.run(lifecycle.submit(face.keys, record, b"in", dedupe_key=dedupe, ttl=TTL))
    face.r.zadd(sent, {record.request_id: 1})
    await face.run(lifecycle.withdraw(face.keys, record.request_id, sent_key=sent, dedupe_key=dedupe))
    assert not face.r.exists(face.keys.future(record.request_id), face.keys.blob_in(record.request_id), dedupe, sent)


# -- reads ----------------------------------------------------------------------------------------------------


async def test_a_record_is_read_with_its_result_once_it_completed(face: Face) -> None:
    record = face.store(face.record())
    rid = record.request_id
    assert await face.run(lifecycle.read_with_result(face.keys, rid)) == (record, None)
    await face.run(lifecycle.finish(face.keys, rid, FutureStatus.COMPLETED, b"out", ttl=TTL))
    read, result = await face.run(lifecycle.read_with_result(face.keys, rid))
    assert read is not None and read.state is FutureStatus.COMPLETED and result == b"out"
    assert await face.run(lifecycle.result(face.keys, rid)) == b"out"
    assert await face.run(lifecycle.read_with_result(face.keys, "gone")) == (None, None)


async def test_the_queue_position_counts_the_ops_ahead_by_the_started_ticket(face: Face) -> None:
    records = [face.record() for _ in range(3)]
    for record in records:
        await face.run(lifecycle.submit(face.keys, record, b"", dedupe_key="", ttl=TTL))
    third = await face.run(lifecycle.read(face.keys, records[2].request_id))
    assert third is not None and await face.run(lifecycle.queue_position(face.keys, third)) == 2
    first = await face.run(lifecycle.read(face.keys, records[0].request_id))
    assert first is not None
    await face.run(lifecycle.begin(face.keys, first, queue=face.queue))
    assert await face.run(lifecycle.queue_position(face.keys, third)) == 1


async def test_a_pool_reads_the_record_its_payload_and_the_named_model_together(face: Face) -> None:
    face.model()
    record = face.store(face.record())
    read = await face.run(lifecycle.read_for_run(face.keys, record.request_id, "m"))
    assert read.record == record and read.payload == b"payload" and ModelRecord.from_hash(read.model).model_id == "m"
    unnamed = await face.run(lifecycle.read_for_run(face.keys, record.request_id, ""))
    assert unnamed.model == {}
    assert (await face.run(lifecycle.read_for_run(face.keys, "gone", "m"))).record is None


async def test_running_and_ended_read_the_state_the_watchers_decide_on(face: Face) -> None:
    queued_one = face.store(face.record())
    running_one = face.store(face.record(status=FutureStatus.RUNNING))
    face.r.hset(face.keys.future(running_one.request_id), "started_at", 123.5)
    done = face.store(face.record(status=FutureStatus.FAILED))
    ids = [queued_one.request_id, running_one.request_id, done.request_id, "gone"]
    assert await face.run(lifecycle.running(face.keys, ids)) == {
        running_one.request_id: lifecycle.Running("forward", 123.5)}
    assert await face.run(lifecycle.running(face.keys, [])) == {}
    assert [await face.run(lifecycle.ended(face.keys, rid)) for rid in ids] == [False, False, True, False]


# -- begin and finish -----------------------------------------------------------------------------------------


async def test_begin_marks_the_op_running_counts_it_on_its_model_and_advances_its_queue(face: Face) -> None:
    face.model()
    record = face.store(face.record())
    record.ticket = 4
    assert await face.run(lifecycle.begin(face.keys, record, queue=face.queue)) == 1
    stored = await face.run(lifecycle.read(face.keys, record.request_id))
    assert stored is not None and stored.state is FutureStatus.RUNNING and stored.started_at > 0
    assert stored.exec_index == 1 and face.r.get(face.keys.queue_started(face.queue)) == b"4"


async def test_the_same_begin_sent_twice_counts_the_op_once_and_a_new_attempt_counts_again(face: Face) -> None:
    """redis-py sends a script again when the broker died before its reply reached the worker."""
    face.model()
    record = face.store(face.record())
    first = await face.run(lifecycle.begin(face.keys, record, queue=face.queue, attempt="attempt-1"))
    again = await face.run(lifecycle.begin(face.keys, record, queue=face.queue, attempt="attempt-1"))
    assert first == again == 1 and face.r.hget(face.keys.model("m"), "ops_executed") == b"1"
    assert await face.run(lifecycle.begin(face.keys, record, queue=face.queue, attempt="attempt-2")) == 2


async def test_begin_and_finish_of_a_vanished_record_write_nothing(face: Face) -> None:
    record = face.record()
    assert await face.run(lifecycle.begin(face.keys, record, queue=face.queue)) is Refused.GONE
    assert await face.run(lifecycle.finish(face.keys, record.request_id, FutureStatus.COMPLETED, b"out",
                                           ttl=TTL)) is Refused.GONE
    assert not face.r.exists(face.keys.future(record.request_id), face.keys.blob_out(record.request_id))


async def test_an_op_a_sweep_failed_while_the_pool_held_it_is_never_begun(face: Face) -> None:
    record = face.store(face.record(status=FutureStatus.FAILED))
    assert await face.run(lifecycle.begin(face.keys, record, queue=face.queue)) is Refused.ALREADY_ENDED
    assert face.status(record.request_id) == "failed"


async def test_a_worker_whose_lease_another_took_is_fenced_off_from_begin_and_finish(face: Face) -> None:
    fence = face.keys.pool_lease_fence(face.queue)
    record = face.store(face.record())
    face.r.set(fence, "the-successor")
    assert await face.run(lifecycle.begin(face.keys, record, queue=face.queue, fence_key=fence,
                                          token="mine")) is Refused.FENCED_OFF
    assert await face.run(lifecycle.finish(face.keys, record.request_id, FutureStatus.COMPLETED, b"out", ttl=TTL,
                                           fence_key=fence, token="mine")) is Refused.FENCED_OFF
    assert face.status(record.request_id) == "queued" and not face.r.exists(face.keys.blob_out(record.request_id))
    assert await face.run(lifecycle.begin(face.keys, record, queue=face.queue, fence_key=fence,
                                          token="the-successor")) == 0
    face.r.delete(fence)  # a broker restarted without persistence: nobody is fenced off
    assert await face.run(lifecycle.finish(face.keys, record.request_id, FutureStatus.COMPLETED, b"out", ttl=TTL,
                                           fence_key=fence, token="mine")) is None


async def test_finish_writes_the_outcome_drops_the_payload_and_wakes_the_long_polls(face: Face) -> None:
    done, failed = face.store(face.record(status=FutureStatus.RUNNING)), face.store(face.record())
    pubsub = face.r.pubsub()
    pubsub.subscribe(face.keys.done_channel(done.request_id))
    assert await face.run(lifecycle.finish(face.keys, done.request_id, FutureStatus.COMPLETED, b"out", ttl=TTL)) is None
    assert await face.run(lifecycle.finish(face.keys, failed.request_id, FutureStatus.FAILED, b"", ttl=TTL, failure={
        "error": "it broke", "category": "user", "code": "bad_input"})) is None
    completed = await face.run(lifecycle.read(face.keys, done.request_id))
    assert completed is not None and completed.state is FutureStatus.COMPLETED and completed.finished_at > 0
    assert face.r.get(face.keys.blob_out(done.request_id)) == b"out"
    assert not face.r.exists(face.keys.blob_in(done.request_id))
    assert 0 < face.r.ttl(face.keys.future(done.request_id)) <= TTL
    broken = await face.run(lifecycle.read(face.keys, failed.request_id))
    assert broken is not None and (broken.status, broken.error, broken.category, broken.code) == (
        "failed", "it broke", "user", "bad_input")
    assert not face.r.exists(face.keys.blob_out(failed.request_id))
    assert _published(pubsub) == [b"completed\nout"]  # a small result goes with the message that wakes the polls


async def test_a_done_message_carries_a_small_result_and_only_the_status_of_a_large_one_or_a_failure(
        face: Face) -> None:
    small, large, failed = (face.store(face.record()) for _ in range(3))
    pubsub = face.r.pubsub()
    pubsub.subscribe(*(face.keys.done_channel(r.request_id) for r in (small, large, failed)))
    big = b"x" * (lifecycle.INLINE_RESULT_BYTES + 1)
    for record, status, result in ((small, FutureStatus.COMPLETED, b"out"), (large, FutureStatus.COMPLETED, big),
                                   (failed, FutureStatus.FAILED, b"")):
        assert await face.run(lifecycle.finish(face.keys, record.request_id, status, result, ttl=TTL)) is None
    messages = [_published_one(pubsub) for _ in range(3)]
    pubsub.close()
    assert messages == [b"completed\nout", b"completed", b"failed"]
    assert [lifecycle.done_result(m) for m in messages] == [b"out", None, None]


def _published_one(pubsub: Any) -> bytes:
    deadline = time.time() + 2
    while time.time() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            return bytes(message["data"])
    raise AssertionError("nothing published")


def _published(pubsub: Any) -> list[bytes]:
    out = []
    deadline = time.time() + 2
    while time.time() < deadline and not out:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            out.append(message["data"])
    pubsub.close()
    return out


# -- failing pending and lost records -------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "fails"), [("queued", True), ("running", True), ("completed", False),
                                               ("failed", False)])
async def test_fail_if_pending_fails_a_queued_or_running_op_and_leaves_an_ended_one(
        face: Face, status: str, fails: bool) -> None:
    record = face.store(face.record(status=status))
    pubsub = face.r.pubsub()
    pubsub.subscribe(face.keys.done_channel(record.request_id))
    assert await face.run(lifecycle.fail_if_pending(face.keys, record.request_id, "hung", "execution_timeout")) is fails
    stored = await face.run(lifecycle.read(face.keys, record.request_id))
    assert stored is not None
    if fails:
        assert (stored.status, stored.error, stored.code, stored.category) == (
            "failed", "hung", "execution_timeout", "server")
        assert _published(pubsub) == [b"failed"]
    else:
        assert stored.status == status and stored.error == ""
        pubsub.close()


async def test_fail_if_pending_never_creates_a_record(face: Face) -> None:
    assert await face.run(lifecycle.fail_if_pending(face.keys, "gone", "hung", "execution_timeout")) is False
    assert not face.r.exists(face.keys.future("gone"))


async def test_a_lost_record_fails_only_while_it_is_as_it_was_read(face: Face) -> None:
    record = face.store(face.record(run_id="old-run"))
    moved_on = face.store(face.record(run_id="old-run"))
    face.r.hset(face.keys.future(moved_on.request_id), "status", "running")  # a worker took it meanwhile
    assert await face.run(lifecycle.fail_if_unchanged(face.keys, record, "lost", time.time())) is True
    assert await face.run(lifecycle.fail_if_unchanged(face.keys, moved_on, "lost", time.time())) is False
    failed = await face.run(lifecycle.read(face.keys, record.request_id))
    assert failed is not None and (failed.status, failed.code, failed.error) == ("failed", "request_lost", "lost")
    assert face.status(moved_on.request_id) == "running"


async def test_a_surviving_record_adopts_the_new_broker_run_and_a_vanished_one_is_not_created(face: Face) -> None:
    record = face.store(face.record(run_id="old-run"))
    await face.run(lifecycle.adopt(face.keys, record.request_id, "new-run"))
    await face.run(lifecycle.adopt(face.keys, "gone", "new-run"))
    assert face.r.hget(face.keys.future(record.request_id), "broker_run_id") == b"new-run"
    assert not face.r.exists(face.keys.future("gone"))


async def test_the_hub_wakes_what_ended_vanished_or_outlived_its_broker_run(face: Face) -> None:
    waiting = face.store(face.record(run_id="run"))
    ended = face.store(face.record(status=FutureStatus.COMPLETED, run_id="run"))
    restarted = face.store(face.record(run_id="old-run"))
    ids = [waiting.request_id, ended.request_id, "gone", restarted.request_id]
    assert await face.run(lifecycle.to_wake(face.keys, ids, "run")) == [1, 2, 3]


# -- many queued ops ------------------------------------------------------------------------------------------


async def test_failing_queued_ops_fails_only_those_still_queued_old_enough_and_of_the_model(face: Face) -> None:
    old = face.store(face.record(age=100))
    young = face.store(face.record())
    other_model = face.store(face.record(age=100, model_id="other"))
    running_one = face.store(face.record(status=FutureStatus.RUNNING, age=100))
    ids = [old.request_id, young.request_id, other_model.request_id, running_one.request_id]
    failed = await face.run(queued.fail_queued(face.keys, ids, error="{op} waited {waited} s", code="queue_timeout",
                                               category="server", ttl=TTL, created_before=time.time() - 50,
                                               model_id="m"))
    assert failed == [0]
    stored = await face.run(lifecycle.read(face.keys, old.request_id))
    assert stored is not None and stored.error == "forward waited 100 s" and stored.code == "queue_timeout"
    assert not face.r.exists(face.keys.blob_in(old.request_id))
    assert [face.status(rid) for rid in ids[1:]] == ["queued", "queued", "running"]


async def test_unparking_takes_ended_ops_out_of_the_keys_backlog(face: Face) -> None:
    backlog = BacklogKeys(face.keys)
    parked = [Parked(new_request_id(), "forward", "m") for _ in range(3)]
    face.r.rpush(backlog.parked(face.queue, "alice"), *[p.encode() for p in parked])
    face.r.sadd(backlog.waiting(face.queue), "alice")
    assert await face.run(queued.unpark(backlog, face.queue, "alice", [parked[1].request_id, "absent"])) == 1
    left = [Parked.decode(raw) for raw in face.r.lrange(backlog.parked(face.queue, "alice"), 0, -1)]
    assert left == [parked[0], parked[2]] and face.r.sismember(backlog.waiting(face.queue), "alice")
    assert await face.run(queued.unpark(backlog, face.queue, "alice", [p.request_id for p in left])) == 2
    assert not face.r.exists(backlog.parked(face.queue, "alice"))
    assert not face.r.sismember(backlog.waiting(face.queue), "alice")


# -- checkpoint saves -----------------------------------------------------------------------------------------


async def test_a_save_is_reserved_below_the_cap_refused_at_it_and_stops_counting_once_it_ended(face: Face) -> None:
    first, second, third = new_request_id(), new_request_id(), new_request_id()

    def reserve(rid: str) -> Call[int | None]:
        return saves.reserve_save(face.keys, "alice", rid, limit=2, grace=60, ttl=TTL)

    assert await face.run(reserve(first)) is None and await face.run(reserve(second)) is None
    assert await face.run(reserve(third)) == 2
    face.r.hset(face.keys.future(first), "status", "completed")
    assert await face.run(reserve(third)) is None
    await face.run(saves.release_save(face.keys, "alice", third))
    assert face.r.zrange(face.keys.checkpoint_writes("alice"), 0, -1) == [second.encode()]


# -- the broker's messages (kombu's unacked hash) -------------------------------------------------------------


def deliver(r: redis.Redis, rid: str, queue: str, *, age: float = 0.0) -> str:
    """An unacked entry the way kombu writes one for a delivered message; returns its tag."""
    tag = uuid.uuid4().hex
    r.hset(UNACKED, tag, messages.entry(json.dumps({"body": "e30=", "headers": {"id": rid}}), "", queue))
    r.zadd(UNACKED_INDEX, {tag: time.time() - age})
    return tag


async def test_a_written_finish_acknowledges_the_ops_message_and_a_refused_one_leaves_it(broker_face: Face) -> None:
    face = broker_face
    written, fenced, vanished = face.store(face.record()), face.store(face.record()), face.record()
    tags = {rid: deliver(face.r, rid, face.queue) for rid in (written.request_id, fenced.request_id,
                                                              vanished.request_id)}
    fence = face.keys.pool_lease_fence(face.queue)
    face.r.set(fence, "mine")
    for record, token, refused in ((written, "mine", None), (fenced, "another", Refused.FENCED_OFF),
                                   (vanished, "mine", Refused.GONE)):
        assert await face.run(lifecycle.finish(face.keys, record.request_id, FutureStatus.COMPLETED, b"out", ttl=TTL,
                                               fence_key=fence, token=token,
                                               delivery_tag=tags[record.request_id])) is refused
    still = {rid for rid, tag in tags.items() if face.r.hexists(UNACKED, tag) and face.r.zscore(UNACKED_INDEX, tag)}
    assert still == {fenced.request_id, vanished.request_id}  # left to the consumer's own ack


async def test_the_request_ids_of_each_queues_unacked_messages_are_decoded(broker_face: Face) -> None:
    now, elsewhere, future = new_request_id(), new_request_id(), "ffffffffffff-made-in-the-far-future"
    deliver(broker_face.r, now, "model.a.0")
    deliver(broker_face.r, elsewhere, "model.b.0")
    deliver(broker_face.r, future, "model.a.0")
    cursor, found = await broker_face.run(messages.held_ids("0", 500, 0, ["model.b.0", "model.a.0"]))
    assert cursor == "0" and sorted(found) == sorted([(0, elsewhere), (1, now), (1, future)])
    _, found = await broker_face.run(messages.held_ids("0", 500, int((time.time() + 60) * 1000), ["model.a.0"]))
    assert found == [(0, now)]  # created before the time asked for


async def test_the_request_ids_of_queued_messages_are_decoded_head_last(broker_face: Face) -> None:
    ids = [new_request_id() for _ in range(3)]
    for rid in ids:
        broker_face.r.lpush("model.a.0", json.dumps({"body": "e30=", "headers": {"lang": "py", "id": rid}}))
    assert await broker_face.run(messages.queue_ids("model.a.0", 0, -1, 0)) == list(reversed(ids))


async def test_a_message_is_sighted_wherever_it_waits(broker_face: Face) -> None:
    face = broker_face
    in_queue, handed, parked, delivered, nowhere = (face.record() for _ in range(5))
    face.r.lpush(face.queue, json.dumps({"headers": {"id": in_queue.request_id}}))
    face.r.lpush(handover_key(face.queue), json.dumps({"headers": {"id": handed.request_id}}))
    face.r.rpush(BacklogKeys(face.keys).parked(face.queue, "alice"), Parked(parked.request_id, "forward", "m").encode())
    deliver(face.r, delivered.request_id, face.queue)
    face.r.set(face.keys.pool_heartbeat(face.queue), json.dumps({"t": 1.0, "held": ["x"]}))
    seen = [await face.run(messages.sighting(face.keys, r)) for r in (in_queue, handed, parked, delivered, nowhere)]
    assert [(s.waiting, s.delivered) for s in seen] == [(True, False), (True, False), (True, False), (False, True),
                                                        (False, False)]
    assert seen[-1].beat == {"t": 1.0, "held": ["x"]}
    running = face.record(status=FutureStatus.RUNNING)
    face.r.lpush(face.queue, json.dumps({"headers": {"id": running.request_id}}))  # a queued op's place only
    assert (await face.run(messages.sighting(face.keys, running))).waiting is False
    assert await face.run(messages.heartbeat(face.keys, "model.none.0")) == {}


async def test_delivered_messages_are_counted_per_queue(broker_face: Face) -> None:
    for queue in ("model.a.0", "model.a.0", "model.b.0"):
        deliver(broker_face.r, new_request_id(), queue)
    broker_face.r.hset(UNACKED, "not-kombus", "not json")
    assert await broker_face.run(messages.deliveries_by_queue()) == {"model.a.0": 2, "model.b.0": 1}


async def test_an_orphan_goes_back_to_the_head_of_its_queue_unless_another_worker_holds_the_lease(
        broker_face: Face) -> None:
    face = broker_face
    rid = new_request_id()
    tag = deliver(face.r, rid, "model.a.0", age=10)
    deliver(face.r, new_request_id(), "model.a.0")  # delivered just now
    assert await face.run(messages.delivered_before(time.time() - 5)) == [tag.encode()]
    found = await face.run(messages.delivery(tag))
    assert found is not None and (found.request_id, found.routing_key) == (rid, "model.a.0")
    face.r.set("fence", "the-successor")
    assert await face.run(messages.restore_orphan(found, "model.a.0", fence_key="fence", token="mine")) is False
    assert await face.run(messages.restore_orphan(found, "model.a.0", fence_key="fence", token="the-successor"))
    assert json.loads(face.r.lindex("model.a.0", -1))["headers"]["id"] == rid  # at the head
    assert await face.run(messages.delivery(tag)) is None and face.r.zscore(UNACKED_INDEX, tag) is None
    assert await face.run(messages.restore_orphan(found, "model.a.0")) is False  # acked (or restored) meanwhile


async def test_a_delivery_is_recorded_from_the_handover_list_and_what_was_never_recorded_returns(
        broker_face: Face) -> None:
    face = broker_face
    face.r.lpush(handover_key("model.a.0"), b"first", b"second")
    entry = messages.entry(json.dumps({"headers": {"id": "r1"}}), "", "model.a.0")
    face.r.lpush("model.a.0", b"behind")
    assert await face.run(messages.record_delivery("model.a.0", "tag-1", entry, b"second")) == 1  # waiting behind
    face.r.delete("model.a.0")
    assert face.r.hget(UNACKED, "tag-1") == entry.encode() and face.r.zscore(UNACKED_INDEX, "tag-1") is not None
    assert face.r.lrange(handover_key("model.a.0"), 0, -1) == [b"first"]
    face.r.lpush("model.a.0", b"queued")
    assert await face.run(messages.return_handover("model.a.0")) == 1
    assert face.r.lrange("model.a.0", 0, -1) == [b"queued", b"first"]  # at the head, the end consumers pop
