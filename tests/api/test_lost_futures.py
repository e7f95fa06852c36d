"""A future record that survived a broker restart while its message did not ends `failed` (real Redis)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from api.lost_futures import LostFutures
from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from twinkle.futures import FutureRecord, FutureStatus, new_request_id
from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED

OLD_RUN, NEW_RUN = "a" * 40, "b" * 40


@pytest.fixture
async def r() -> AsyncIterator[aioredis.Redis]:
    require_redis()
    client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    yield client
    await client.aclose()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"test-{uuid.uuid4().hex[:8]}:")  # nothing of one test is seen by another


async def stored(r: aioredis.Redis, keys: Keys, status: str = FutureStatus.QUEUED, run_id: str = OLD_RUN,
                 started_at: float = 0.0) -> FutureRecord:
    record = FutureRecord(request_id=new_request_id(), op="optim_step", owner="t", model_id="m",
                          queue=f"{keys.prefix}model.pool.0", status=status, broker_run_id=run_id,
                          started_at=started_at, created_at=time.time())
    await r.hset(keys.future(record.request_id), mapping=record.to_hash())
    await r.expire(keys.future(record.request_id), 60)
    return record


async def test_a_queued_future_whose_message_is_gone_fails_once_and_wakes_its_waiters(
        r: aioredis.Redis, keys: Keys) -> None:
    record = await stored(r, keys)
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.done_channel(record.request_id))
    seen = await LostFutures(r, keys).check(record, NEW_RUN)
    assert seen.status == FutureStatus.FAILED and seen.code == "request_lost"
    stored_now = FutureRecord.from_hash(await r.hgetall(keys.future(record.request_id)))
    assert stored_now.status == FutureStatus.FAILED and "Submit it again" in stored_now.error
    message = None
    for _ in range(20):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            break
    assert message is not None and message["data"] == b"failed"
    await pubsub.aclose()


async def test_a_queued_future_whose_message_survived_adopts_the_new_broker(r: aioredis.Redis, keys: Keys) -> None:
    record = await stored(r, keys)
    await r.rpush(record.queue, json.dumps({"headers": {"id": record.request_id}, "body": "..."}))
    seen = await LostFutures(r, keys).check(record, NEW_RUN)
    assert seen.status == FutureStatus.QUEUED
    assert await r.hget(keys.future(record.request_id), "broker_run_id") == NEW_RUN.encode()
    await r.delete(record.queue)


async def test_a_delivered_unacknowledged_message_counts_as_surviving(r: aioredis.Redis, keys: Keys) -> None:
    record = await stored(r, keys)
    tag = f"{keys.prefix}tag"
    await r.hset(UNACKED, tag, json.dumps([{"headers": {"id": record.request_id}}, "", record.queue]))
    try:
        assert (await LostFutures(r, keys).check(record, NEW_RUN)).status == FutureStatus.QUEUED
    finally:
        await r.hdel(UNACKED, tag)


async def test_a_running_future_is_lost_once_a_heartbeat_newer_than_its_start_names_another_op(
        r: aioredis.Redis, keys: Keys) -> None:
    record = await stored(r, keys, status=FutureStatus.RUNNING, started_at=time.time() - 5)
    lost = LostFutures(r, keys)
    beat = keys.pool_heartbeat(record.queue)
    await r.set(beat, json.dumps({"t": time.time() - 10, "current": ""}), ex=60)  # from before it started
    assert (await lost.check(record, NEW_RUN)).status == FutureStatus.RUNNING
    await r.set(beat, json.dumps({"t": time.time(), "current": "someone-else"}), ex=60)
    assert (await lost.check(record, NEW_RUN)).status == FutureStatus.FAILED


async def test_a_running_future_its_worker_reports_is_kept(r: aioredis.Redis, keys: Keys) -> None:
    record = await stored(r, keys, status=FutureStatus.RUNNING, started_at=time.time() - 5)
    await r.set(keys.pool_heartbeat(record.queue), json.dumps({"t": time.time(), "current": record.request_id}),
                ex=60)
    assert (await LostFutures(r, keys).check(record, NEW_RUN)).status == FutureStatus.RUNNING
    assert await r.hget(keys.future(record.request_id), "broker_run_id") == NEW_RUN.encode()


async def test_a_running_future_of_a_clock_cycle_is_kept_when_the_heartbeat_holds_it(
        r: aioredis.Redis, keys: Keys) -> None:
    record = await stored(r, keys, status=FutureStatus.RUNNING, started_at=time.time() - 5)
    beat = {"t": time.time(), "current": "another-op-of-the-cycle", "held": ["another-op-of-the-cycle",
                                                                             record.request_id]}
    await r.set(keys.pool_heartbeat(record.queue), json.dumps(beat), ex=60)
    assert (await LostFutures(r, keys).check(record, NEW_RUN)).status == FutureStatus.RUNNING


async def test_a_record_from_the_current_broker_is_left_alone(r: aioredis.Redis, keys: Keys) -> None:
    record = await stored(r, keys, run_id=NEW_RUN)
    assert (await LostFutures(r, keys).check(record, NEW_RUN)).status == FutureStatus.QUEUED


async def test_a_queued_message_its_worker_holds_in_memory_survives_and_one_nobody_holds_is_lost(
        r: aioredis.Redis, keys: Keys) -> None:
    # Delivered just before the broker went away: in no queue and no unacked hash, but prefetched by its worker.
    restarted = time.time() - 5
    held, gone = await stored(r, keys), await stored(r, keys)
    lost = LostFutures(r, keys)
    beat = keys.pool_heartbeat(held.queue)
    await r.set(beat, json.dumps({"t": restarted - 1, "held": [held.request_id]}), ex=60)  # from the old broker
    assert (await lost.check(held, NEW_RUN, broker_started_at=restarted)).status == FutureStatus.QUEUED
    assert await r.hget(keys.future(held.request_id), "broker_run_id") == OLD_RUN.encode()  # undecided yet
    await r.set(beat, json.dumps({"t": time.time(), "held": [held.request_id]}), ex=60)
    assert (await lost.check(held, NEW_RUN, broker_started_at=restarted)).status == FutureStatus.QUEUED
    assert await r.hget(keys.future(held.request_id), "broker_run_id") == NEW_RUN.encode()
    assert (await lost.check(gone, NEW_RUN, broker_started_at=restarted)).code == "request_lost"


async def test_a_queued_future_whose_worker_restarted_after_it_was_submitted_is_lost_unless_found(
        r: aioredis.Redis, keys: Keys) -> None:
    # A worker killed or frozen between popping a message and recording it as unacked took it along.
    restarted = time.time() + 1  # the records below were submitted before this worker started
    gone, requeued = await stored(r, keys, run_id=NEW_RUN), await stored(r, keys, run_id=NEW_RUN)
    await r.rpush(requeued.queue, f'{{"headers": {{"id": "{requeued.request_id}"}}}}')
    await r.expire(requeued.queue, 60)
    lost = LostFutures(r, keys)
    beat = keys.pool_heartbeat(gone.queue)
    await r.set(beat, json.dumps({"t": restarted + 1, "held": [], "since": restarted}), ex=60)
    assert (await lost.check(requeued, NEW_RUN)).status == FutureStatus.QUEUED
    assert (await lost.check(gone, NEW_RUN)).code == "request_lost"
    await r.set(beat, json.dumps({"t": time.time(), "held": [], "since": time.time() - 3600}), ex=60)
    fresh = await stored(r, keys, run_id=NEW_RUN)  # submitted to a worker that was already running
    assert (await lost.check(fresh, NEW_RUN)).status == FutureStatus.QUEUED


async def test_a_queued_future_read_past_its_queues_timeout_fails_with_queue_timeout_and_wakes_its_waiters(
        r: aioredis.Redis, keys: Keys) -> None:
    late, prompt = await stored(r, keys, run_id=NEW_RUN), await stored(r, keys, run_id=NEW_RUN)
    running = await stored(r, keys, status=FutureStatus.RUNNING, run_id=NEW_RUN, started_at=time.time())
    for record in (late, running):
        record.created_at = time.time() - 30
        await r.hset(keys.future(record.request_id), "created_at", record.created_at)
    lost = LostFutures(r, keys)
    lost.queue_timeouts = {late.queue: 5}
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.done_channel(late.request_id))
    seen = await lost.check(late, NEW_RUN)
    assert (seen.status, seen.code, seen.category) == (FutureStatus.FAILED, "queue_timeout", "server")
    assert f"optim_step waited 30 s in the queue of {late.queue}, longer than its queue_timeout of 5 s" in seen.error
    message = None
    for _ in range(20):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            break
    assert message is not None and message["data"] == b"failed"
    await pubsub.aclose()
    assert (await lost.check(prompt, NEW_RUN)).status == FutureStatus.QUEUED  # within its timeout
    assert (await lost.check(running, NEW_RUN)).status == FutureStatus.RUNNING  # begun: the worker's to end
