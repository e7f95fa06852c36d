"""The API's Redis client after a broker restart: a pooled connection whose EOF the event loop has not read
yet must not turn the first request after the restart into a 503."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from api.redis_client import redis_client
from tests.private_redis import PrivateRedis


async def test_the_first_commands_after_a_broker_restart_succeed_on_fresh_connections(tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    r = redis_client(broker.url)
    try:
        await asyncio.gather(*(r.set(f"k{i}", i) for i in range(8)))  # eight pooled, idle connections
        # kill and start without yielding to the loop: every pooled connection still looks alive
        broker.kill()
        broker.start()
        assert [await r.set(f"k{i}", i) for i in range(8)] == [True] * 8
    finally:
        await r.aclose()
        broker.kill()


async def test_a_broker_that_stays_down_still_fails_at_once(tmp_path: Path) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    r = redis_client(broker.url)
    try:
        await r.set("k", 1)
        broker.kill()
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(r.get("k"), 2)
    finally:
        await r.aclose()
