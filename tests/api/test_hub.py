"""The future hub: one pattern subscription per API process wakes every parked long-poll, a parked poll holds
no Redis connection, and a wake-up lost to a broken connection is found by the re-read after reconnecting."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from api.hub import READ_BATCH, FutureHub
from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from tests.private_redis import PrivateRedis
from twinkle.keys import Keys


def test_keys() -> Keys:
    return Keys(f"test-hub-{uuid.uuid4().hex[:8]}:[x]*")  # glob characters in the prefix stay literal


test_keys.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    require_redis()
    name = f"test-hub-{uuid.uuid4().hex[:8]}"
    pool = aioredis.BlockingConnectionPool(host=REDIS_HOST, port=REDIS_PORT, db=1, max_connections=4,
                                           timeout=5, client_name=name)
    r = aioredis.Redis.from_pool(pool)
    yield r
    await r.aclose()


async def started(r: aioredis.Redis, keys: Keys) -> FutureHub:
    hub = FutureHub(r, keys)
    await hub.start()
    await asyncio.wait_for(hub.subscribed.wait(), 5)
    return hub


async def test_a_result_published_right_after_a_waiter_registered_always_wakes_it(client: aioredis.Redis) -> None:
    keys = test_keys()
    hub = await started(client, keys)
    publisher = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    missed = 0
    try:
        for i in range(500):
            waiter = hub.register(f"r{i}")
            await publisher.publish(keys.done_channel(f"r{i}"), "completed")
            try:
                await asyncio.wait_for(waiter.wait(), 2)
            except TimeoutError:
                missed += 1
            hub.unregister(waiter)
        await publisher.publish(keys.done_channel("other") + "x", "completed")  # another future: nobody wakes
    finally:
        await publisher.aclose()
        await hub.close()
    assert missed == 0
    assert hub.pending == 0


async def test_two_thousand_parked_waiters_hold_no_redis_connection_and_all_wake(client: aioredis.Redis) -> None:
    keys = test_keys()
    hub = await started(client, keys)
    publisher = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    try:
        waiters = [hub.register(f"r{i}") for i in range(2000)]
        waiters.append(hub.register("r0"))  # two polls of one future both wake
        assert hub.pending == 2001
        name = (await client.client_getname()) or ""
        connections = [c for c in await publisher.client_list() if c.get("name") == name]
        assert len(connections) <= 3, connections  # the subscription, a re-read's, the one that just asked
        pipe = publisher.pipeline(transaction=False)
        for i in range(2000):
            pipe.publish(keys.done_channel(f"r{i}"), "completed")
        await pipe.execute()
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in waiters)), 10)
        for waiter in waiters:
            hub.unregister(waiter)
        assert hub.pending == 0
    finally:
        await publisher.aclose()
        await hub.close()


async def test_the_batched_re_read_wakes_waiters_whose_future_ended_vanished_or_outlived_its_broker(
        client: aioredis.Redis) -> None:
    keys = test_keys()
    hub = FutureHub(client, keys)  # not started: only the re-read can wake anyone
    run_id = str((await client.info("server"))["run_id"])
    records: dict[str, dict[Any, Any]] = {"done": {"status": "completed"}, "failed": {"status": "failed"},
               "old-broker": {"status": "running", "broker_run_id": "an-earlier-run"},
               "busy": {"status": "running", "broker_run_id": run_id}}
    busy_many = [f"busy-{i}" for i in range(2 * READ_BATCH + 7)]  # more than one batch
    try:
        for request_id, record in records.items():
            await client.hset(keys.future(request_id), mapping=record)
        for request_id in busy_many:
            await client.hset(keys.future(request_id), mapping={"status": "running"})
        waiters = {request_id: hub.register(request_id) for request_id in [*records, "gone", *busy_many]}
        assert await hub.recheck() == 4
        assert {rid for rid, waiter in waiters.items() if waiter.woken} == {
            "done", "failed", "old-broker", "gone"}
    finally:
        await client.delete(*(keys.future(rid) for rid in [*records, *busy_many]))


async def test_a_wake_up_lost_while_the_broker_was_down_is_found_after_it_returns(tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    keys = test_keys()
    r = aioredis.Redis.from_url(broker.url)
    hub = await started(r, keys)
    try:
        await r.hset(keys.future("slow"), mapping={"status": "running"})
        waiter = hub.register("slow")
        await asyncio.to_thread(broker.outage, 1.0)  # an empty Redis comes back: the message is never sent
        began = time.monotonic()
        await asyncio.wait_for(hub.subscribed.wait(), 10)
        await asyncio.wait_for(waiter.wait(), 10)  # its record vanished: the poll's own read decides
        assert time.monotonic() - began < 10
        assert hub.reconnects >= 1
        fresh = hub.register("fresh")
        await r.publish(keys.done_channel("fresh"), "completed")
        await asyncio.wait_for(fresh.wait(), 2)
    finally:
        await hub.close()
        await r.aclose()
        broker.kill()
