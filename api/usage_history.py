"""The usage ledger the pools write (twinkle/usage.py), as the API's reports read it: which tenants it has seen,
and a tenant's amounts per UTC day, as day totals or as `run|model|metric` details."""

from __future__ import annotations

import redis.asyncio as aioredis

from twinkle.keys import Keys
from twinkle.usage import UsageKeys, decode_hash


class UsageHistory:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = UsageKeys(keys)

    async def tenants(self) -> list[str]:
        """Every tenant the ledger has seen, sorted."""
        members = await self.r.smembers(self.keys.tenants())
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)

    async def per_day(self, tenant: str, days: list[str], *, details: bool) -> list[dict[str, int]]:
        """The tenant's day totals (or detail hashes) of each of `days`, in their order; empty for a day without."""
        pipe = self.r.pipeline(transaction=False)
        for day in days:
            pipe.hgetall(self.keys.detail(tenant, day) if details else self.keys.day(tenant, day))
        return [decode_hash(raw) for raw in await pipe.execute()]
