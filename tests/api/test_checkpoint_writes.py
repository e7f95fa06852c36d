"""The per-key cap on outstanding checkpoint saves, against the real Redis: a save counts until its future
ends, however it ends, with nothing to decrement."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from api.checkpoint_writes import CheckpointWrites
from tests.harness import async_redis
from twinkle.errors import RateLimited
from twinkle.futures import new_request_id
from twinkle.keys import Keys


@pytest.fixture
async def r() -> AsyncIterator[aioredis.Redis]:
    async with async_redis(db=2) as client:
        yield client


def writes(r: aioredis.Redis, per_key: int = 2) -> CheckpointWrites:
    return CheckpointWrites(r, Keys(f"test-{uuid.uuid4().hex[:8]}:"), per_key=per_key, future_ttl=600)


async def submitted(w: CheckpointWrites, owner: str, status: str = "queued") -> str:
    rid = new_request_id()
    await w.reserve(owner, rid)
    await w.ledger.r.hset(w.keys.future(rid), mapping={"status": status, "owner": owner})
    await w.ledger.r.expire(w.keys.future(rid), 60)
    return rid


async def test_one_save_over_the_cap_is_refused_with_a_retry_after(r: aioredis.Redis) -> None:
    w = writes(r)
    first, _ = await submitted(w, "alice"), await submitted(w, "alice")
    with pytest.raises(RateLimited) as refused:
        await w.reserve("alice", new_request_id())
    assert refused.value.status_code == 429 and refused.value.details["retry_after"] > 0
    assert "2 checkpoint saves queued or running" in str(refused.value)
    await submitted(w, "bob")  # another key has its own cap
    await r.hset(w.keys.future(first), "status", "running")
    with pytest.raises(RateLimited):
        await w.reserve("alice", new_request_id())


@pytest.mark.parametrize("ending", ["completed", "failed", "expired"])
async def test_a_save_stops_counting_once_its_future_ends_however_it_ends(r: aioredis.Redis, ending: str) -> None:
    w = writes(r, per_key=1)
    rid = await submitted(w, "alice")
    if ending == "expired":
        await r.delete(w.keys.future(rid))
        await r.zadd(w.keys.checkpoint_writes("alice"), {rid: 0})  # reserved long ago, future gone
    else:
        await r.hset(w.keys.future(rid), "status", ending)
    await submitted(w, "alice")


async def test_a_reservation_whose_future_is_not_written_yet_counts(r: aioredis.Redis) -> None:
    w = writes(r, per_key=1)
    await w.reserve("alice", new_request_id())  # its submit is under way
    with pytest.raises(RateLimited):
        await w.reserve("alice", new_request_id())


async def test_twenty_concurrent_reservations_admit_exactly_the_cap(r: aioredis.Redis) -> None:
    w = writes(r, per_key=3)
    results = await asyncio.gather(*(w.reserve("alice", new_request_id()) for _ in range(20)),
                                   return_exceptions=True)
    assert sum(1 for x in results if x is None) == 3
    assert all(isinstance(x, RateLimited) for x in results if x is not None)


async def test_zero_means_unlimited_and_a_released_reservation_frees_its_place(r: aioredis.Redis) -> None:
    unlimited = writes(r, per_key=0)
    for _ in range(10):
        await unlimited.reserve("alice", new_request_id())
    w = writes(r, per_key=1)
    rid = new_request_id()
    await w.reserve("alice", rid)
    await w.release("alice", rid)
    await w.reserve("alice", new_request_id())
