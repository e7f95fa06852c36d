"""Quotas per API key: what a key's tier allows of each metered quantity per UTC day, month or ever
(`tenancy.tiers.<tier>.quotas`, twinkle.tenancy), checked when the API accepts an op.

The usage is what the pools recorded for the tenant's completed ops (twinkle.usage). One pipelined read of the
quota fields of the period hashes, and only for a key whose tier has a quota that can refuse the op; other keys
cost nothing. Quotas are checked at admission only: ops already accepted are never dropped, so a key can go
over a quota by what its queued ops use. A refusal is QuotaExceeded (403), which the Tinker SDK raises at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis.asyncio as aioredis

from twinkle.keys import Keys
from twinkle.tenancy import TenantPolicy, quota_exceeded
from twinkle.usage import UsageKeys, period_end


class QuotaGate:
    def __init__(self, r: aioredis.Redis, keys: Keys, *, clock: Callable[[], float] = time.time) -> None:
        self.r = r
        self.usage = UsageKeys(keys)
        self.clock = clock

    async def check(self, tenant: str, policy: TenantPolicy, op: str) -> None:
        """Raise QuotaExceeded when a quota of `policy` that applies to `op` is used up."""
        quotas = policy.quotas_for(op)
        if not quotas:
            return
        now = self.clock()
        pipe = self.r.pipeline(transaction=False)
        for quota in quotas:
            pipe.hget(self.usage.period(tenant, quota.period, now), quota.metric)
        used = [int(raw or 0) for raw in await pipe.execute()]
        over = [(quota, amount) for quota, amount in zip(quotas, used, strict=True) if amount >= quota.limit]
        if over:  # the one that lasts longest: waiting for a daily reset helps nothing if the month is used up
            quota, amount = max(over, key=lambda item: period_end(item[0].period, now))
            raise quota_exceeded(op, policy, quota, amount, now)
