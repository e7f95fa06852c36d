"""The sliding-window limiter against the real Redis (its Lua scripts are the part worth testing)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from api.ratelimit import RateLimiter, request_window
from tests.harness import async_redis
from twinkle.config import QueueConfig
from twinkle.errors import InvalidRequest, RateLimited
from twinkle.keys import Keys

QUEUE = "model.pool.0"


@pytest.fixture
async def r() -> AsyncIterator[aioredis.Redis]:
    async with async_redis(db=2) as client:
        yield client


def limiter(r: aioredis.Redis, **config: Any) -> RateLimiter:
    # a fresh key prefix per test: no test sees another's windows, and nothing needs flushing
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    return RateLimiter(r, keys, {"pool": QueueConfig(**config)}, {QUEUE: "pool"})


async def test_requests_over_the_rate_are_refused_with_the_time_until_one_fits(r: aioredis.Redis) -> None:
    lim = limiter(r, rps_limit=5, window_seconds=0.5)
    for _ in range(2):
        await lim.admit("alice", QUEUE)
    with pytest.raises(RateLimited) as refused:
        await lim.admit("alice", QUEUE)
    assert 0 < refused.value.details["retry_after"] <= 0.5
    assert refused.value.status_code == 429
    await asyncio.sleep(refused.value.details["retry_after"] + 0.02)
    await lim.admit("alice", QUEUE)


async def test_each_key_has_its_own_window(r: aioredis.Redis) -> None:
    lim = limiter(r, rps_limit=1)
    await lim.admit("alice", QUEUE)
    await lim.admit("bob", QUEUE)
    with pytest.raises(RateLimited):
        await lim.admit("alice", QUEUE)


async def test_refused_requests_do_not_extend_the_window(r: aioredis.Redis) -> None:
    lim = limiter(r, rps_limit=10, window_seconds=0.3)
    for _ in range(3):
        await lim.admit("alice", QUEUE)
    started = time.monotonic()
    while time.monotonic() - started < 0.25:
        with pytest.raises(RateLimited):
            await lim.admit("alice", QUEUE)
    await asyncio.sleep(0.1)
    await lim.admit("alice", QUEUE)


async def test_tokens_over_the_rate_are_refused_and_counted(r: aioredis.Redis) -> None:
    lim = limiter(r, tps_limit=100)
    await lim.admit("alice", QUEUE, input_tokens=60)
    with pytest.raises(RateLimited) as refused:
        await lim.admit("alice", QUEUE, input_tokens=60)
    assert "input tokens/s" in str(refused.value)
    await lim.admit("alice", QUEUE, input_tokens=40)
    assert await lim.over_limit("alice", QUEUE) is not None
    assert await lim.over_limit("bob", QUEUE) is None
    counts = await r.hgetall(lim.keys.rate_rejections())
    assert counts == {b"pool:tokens": b"1"}


async def test_a_request_no_window_can_hold_is_a_user_error_not_a_429(r: aioredis.Redis) -> None:
    lim = limiter(r, tps_limit=100, max_input_tokens=500)
    with pytest.raises(InvalidRequest, match="at most 500"):
        await lim.admit("alice", QUEUE, input_tokens=501)
    with pytest.raises(InvalidRequest, match="per key in one window") as too_big:
        await lim.admit("alice", QUEUE, input_tokens=101)
    assert too_big.value.status_code == 400


async def test_zero_means_unlimited_and_disabled_means_no_limits(r: aioredis.Redis) -> None:
    unlimited = limiter(r)
    disabled = limiter(r, enabled=False, rps_limit=1, max_input_tokens=1)
    for _ in range(50):
        await unlimited.admit("alice", QUEUE, input_tokens=10**6)
        await disabled.admit("alice", QUEUE, input_tokens=10**6)
    assert await r.exists(unlimited.keys.rate_window("alice", "pool", "requests")) == 0


async def test_windows_expire_once_idle(r: aioredis.Redis) -> None:
    lim = limiter(r, rps_limit=10, tps_limit=1000, window_seconds=2)
    await lim.admit("alice", QUEUE, input_tokens=5)
    for what in ("requests", "tokens"):
        ttl = await r.pttl(lim.keys.rate_window("alice", "pool", what))
        assert 0 < ttl <= 2000


async def test_concurrent_admissions_never_exceed_the_limit(r: aioredis.Redis) -> None:
    lim = limiter(r, rps_limit=7, window_seconds=5)  # long window: all 40 land inside it
    outcomes = await asyncio.gather(*(lim.admit("alice", QUEUE) for _ in range(40)), return_exceptions=True)
    assert sum(o is None for o in outcomes) == 35
    assert all(isinstance(o, RateLimited) for o in outcomes if o is not None)


def test_a_rate_below_one_per_window_stretches_the_window() -> None:
    window = request_window(QueueConfig(rps_limit=0.5, window_seconds=1))
    assert (window.allowed, window.seconds) == (1, 2)
