"""The shared pub/sub listener wakes a long-poll for every result published once `register` returned."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from api.hub import FutureHub
from tests.harness import REDIS_HOST, REDIS_PORT, require_redis


@pytest.fixture
async def hub() -> AsyncIterator[FutureHub]:
    require_redis()
    client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    hub = FutureHub(client)
    await hub.start()
    yield hub
    await hub.close()
    await client.aclose()


async def test_register_returns_only_once_redis_confirmed_the_subscription(monkeypatch: pytest.MonkeyPatch) -> None:
    # Redis may run a command sent later on another connection (the long-poll's re-read of the record)
    # before a SUBSCRIBE: a result published in between was lost, about one wake-up in 700 (a 5 s stall).
    require_redis()
    monkeypatch.setattr("api.hub.CONFIRM_SECONDS", 0.5)
    client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    unread = FutureHub(client)  # no listener runs: the confirmation is never read
    try:
        began = time.monotonic()
        await unread.register(f"test-hub-{uuid.uuid4().hex[:8]}")
        assert time.monotonic() - began >= 0.5
        listened = FutureHub(client)
        await listened.start()
        began = time.monotonic()
        await listened.register(f"test-hub-{uuid.uuid4().hex[:8]}")
        assert time.monotonic() - began < 0.5
        await listened.close()
    finally:
        await unread.close()
        await client.aclose()


async def test_a_result_published_right_after_register_returns_always_wakes_its_waiter(hub: FutureHub) -> None:
    publisher = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    prefix = f"test-hub-{uuid.uuid4().hex[:8]}:"
    missed = 0
    try:
        for i in range(2000):
            channel = f"{prefix}{i}"
            waiter = await hub.register(channel)
            await publisher.publish(channel, "completed")
            try:
                await asyncio.wait_for(waiter, 2)
            except TimeoutError:
                missed += 1
            await hub.unregister(channel, waiter)
    finally:
        await publisher.aclose()
    assert missed == 0
    assert hub.pending == 0


async def test_every_waiter_of_a_channel_wakes_and_the_last_one_out_unsubscribes(hub: FutureHub) -> None:
    channel = f"test-hub-{uuid.uuid4().hex[:8]}"
    first, second = await hub.register(channel), await hub.register(channel)
    assert hub.pending == 2
    publisher = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    try:
        await publisher.publish(channel, "failed")
        await asyncio.wait_for(asyncio.gather(first, second), 2)
        await hub.unregister(channel, first)
        assert await publisher.pubsub_numsub(channel) == [(channel.encode(), 1)]
        await hub.unregister(channel, second)
        for _ in range(50):
            if await publisher.pubsub_numsub(channel) == [(channel.encode(), 0)]:
                break
            await asyncio.sleep(0.02)
        assert await publisher.pubsub_numsub(channel) == [(channel.encode(), 0)]
    finally:
        await publisher.aclose()
