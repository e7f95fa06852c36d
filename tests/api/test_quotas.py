"""Quotas at admission, against the real Redis and the usage the pools record (twinkle.usage.UsageLedger)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from api.quotas import QuotaGate
from tests.harness import REDIS_HOST, REDIS_PORT, async_redis
from twinkle.errors import QuotaExceeded
from twinkle.futures import FutureRecord, Op, new_request_id
from twinkle.keys import Keys
from twinkle.tenancy import Quota, TenantPolicy
from twinkle.usage import UsageLedger

DB = 2
NOW = datetime(2025, 6, 30, 12, 0, tzinfo=UTC).timestamp()
FREE = TenantPolicy(tier="free", quotas=(Quota("trained_tokens", "day", 1000), Quota("sampled_tokens", "month", 50),
                                         Quota("checkpoint_bytes", "total", 10**6), Quota("pool_ms", "day", 60_000)))


@pytest.fixture
async def r() -> AsyncIterator[aioredis.Redis]:
    async with async_redis(db=DB) as client:
        yield client


@pytest.fixture
def keys() -> Iterator[Keys]:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    yield Keys(prefix)
    sync = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=DB)
    for key in sync.scan_iter(f"{prefix}*"):  # usage totals never expire
        sync.delete(key)


def record_usage(keys: Keys, tenant: str, amounts: dict[str, int], at: float = NOW) -> None:
    """What a pool records when one of `tenant`'s ops completes."""
    sync = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=DB)
    rec = FutureRecord(request_id=new_request_id(), op="forward_backward", owner=tenant, model_id="run-1", queue="q")
    sync.hset(keys.future(rec.request_id), mapping=rec.to_hash())
    sync.expire(keys.future(rec.request_id), 60)
    assert UsageLedger(sync, keys).record(rec, "tiny-qwen", amounts, at=at)


def gate(r: aioredis.Redis, keys: Keys, at: float = NOW) -> QuotaGate:
    return QuotaGate(r, keys, clock=lambda: at)


async def test_ops_are_admitted_until_the_quota_is_used_up_then_refused_naming_used_limit_and_reset(
        r: aioredis.Redis, keys: Keys) -> None:
    quotas = gate(r, keys)
    record_usage(keys, "alice", {"trained_tokens": 999})
    await quotas.check("alice", FREE, Op.FORWARD_BACKWARD)
    record_usage(keys, "alice", {"trained_tokens": 1})
    with pytest.raises(QuotaExceeded) as refused:
        await quotas.check("alice", FREE, Op.FORWARD_BACKWARD)
    assert refused.value.details == {"quantity": "trained_tokens", "period": "day", "used": 1000, "limit": 1000,
                                     "resets_at": "2025-07-01T00:00:00Z", "tier": "free"}
    assert "forward_backward refused" in str(refused.value)
    await quotas.check("alice", FREE, Op.FORWARD)  # a quota on trained tokens leaves forward alone
    await quotas.check("alice", FREE, Op.OPTIM_STEP)
    await quotas.check("bob", FREE, Op.FORWARD_BACKWARD)  # another key has its own usage


async def test_a_daily_quota_admits_again_the_next_utc_day(r: aioredis.Redis, keys: Keys) -> None:
    record_usage(keys, "alice", {"trained_tokens": 5000})
    with pytest.raises(QuotaExceeded):
        await gate(r, keys).check("alice", FREE, Op.FORWARD_BACKWARD)
    await gate(r, keys, NOW + 86400).check("alice", FREE, Op.FORWARD_BACKWARD)


async def test_monthly_and_total_quotas_sum_the_whole_period(r: aioredis.Redis, keys: Keys) -> None:
    record_usage(keys, "alice", {"sampled_tokens": 30, "checkpoint_bytes": 600_000},
                 at=datetime(2025, 6, 2, tzinfo=UTC).timestamp())
    record_usage(keys, "alice", {"sampled_tokens": 20, "checkpoint_bytes": 400_000})
    with pytest.raises(QuotaExceeded, match=r"50 sampled_tokens this month.*resets at 2025-07-01T00:00:00Z"):
        await gate(r, keys).check("alice", FREE, Op.SAMPLE)
    with pytest.raises(QuotaExceeded, match="never resets") as refused:
        await gate(r, keys, NOW + 365 * 86400).check("alice", FREE, Op.SAVE_WEIGHTS_FOR_SAMPLER)
    assert refused.value.details["resets_at"] is None


async def test_pool_time_refuses_every_compute_op_but_not_an_unload(r: aioredis.Redis, keys: Keys) -> None:
    record_usage(keys, "alice", {"pool_ms": 60_000})
    for op in (Op.FORWARD, Op.FORWARD_BACKWARD, Op.OPTIM_STEP, Op.SAMPLE, Op.SAVE_STATE, Op.CREATE_MODEL, Op.ENCODE):
        with pytest.raises(QuotaExceeded, match="pool_ms"):
            await gate(r, keys).check("alice", FREE, op)
    await gate(r, keys).check("alice", FREE, Op.UNLOAD_MODEL)


async def test_the_refusal_names_the_quota_that_lasts_longest(r: aioredis.Redis, keys: Keys) -> None:
    policy = TenantPolicy(quotas=(Quota("optim_steps", "day", 1), Quota("optim_steps", "month", 2)))
    mid_month = datetime(2025, 6, 15, 12, 0, tzinfo=UTC).timestamp()
    record_usage(keys, "alice", {"optim_steps": 2}, at=mid_month)
    with pytest.raises(QuotaExceeded) as refused:
        await gate(r, keys, mid_month).check("alice", policy, Op.OPTIM_STEP)
    assert refused.value.details["period"] == "month"  # waiting for the day's reset would not help


class NoRedis:
    def pipeline(self, **_: Any) -> Any:
        raise AssertionError("a key without quotas must cost no Redis round trip")


async def test_a_key_without_quotas_on_the_op_costs_no_redis_round_trip(keys: Keys) -> None:
    quotas = QuotaGate(NoRedis(), keys)  # type: ignore[arg-type]
    await quotas.check("alice", TenantPolicy(), Op.FORWARD_BACKWARD)
    await quotas.check("alice", FREE, Op.UNLOAD_MODEL)
