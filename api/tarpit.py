"""Keys that keep hammering after their 429s get those 429s slowly.

A refused request costs the API a whole pass through its stack (about a millisecond of CPU), so a client that
keeps many requests in flight and resends each one the moment its 429 arrives makes the API spend most of a
core on refusals, and every other tenant waits behind them in the event loop. The rate limit cannot help:
it refuses, it does not slow the sender.

So each key has an allowance of free refusals, a bucket of `free_burst` refilled at `free_per_second`; a 429
beyond it is held for about `penalty_seconds` (jittered, so that held answers do not all go out, and come
back, in one burst) before it goes out, its Retry-After shortened by as much. A client that keeps N requests
in flight then gets about N answers per penalty, whatever it does. A client that honours Retry-After (the
Tinker SDK does) rarely empties its allowance and then waits about as long as it was told to anyway; nothing
that would be admitted is ever delayed. At most `max_held` answers per key are held at once; beyond that
they go out at once. The buckets are per API process; a full one is forgotten.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

PENALTY_SECONDS = 1.0
FREE_PER_SECOND = 5.0
FREE_BURST = 20
MAX_HELD_PER_KEY = 64
_PRUNE_AT = 10_000


@dataclass
class _Bucket:
    tokens: float
    at: float


class Tarpit:
    def __init__(self, penalty_seconds: float = PENALTY_SECONDS, *, free_per_second: float = FREE_PER_SECOND,
                 free_burst: int = FREE_BURST, max_held: int = MAX_HELD_PER_KEY) -> None:
        self.penalty_seconds = penalty_seconds
        self.free_per_second = free_per_second
        self.free_burst = free_burst
        self.max_held = max_held
        self._buckets: dict[str, _Bucket] = {}
        self._held: Counter[str] = Counter()

    async def refuse(self, tenant: str, retry_after: float) -> float:
        """Called as a 429 is about to go out to `tenant`; holds it when the key has used up its free
        refusals. Returns the Retry-After (seconds) to send."""
        if self.penalty_seconds <= 0 or self._take_free(tenant) or self._held[tenant] >= self.max_held:
            return retry_after
        self._held[tenant] += 1
        penalty = self.penalty_seconds * (0.5 + random.random())
        try:
            await asyncio.sleep(penalty)
        finally:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]
        return max(0.001, retry_after - penalty)

    def _take_free(self, tenant: str) -> bool:
        now = time.monotonic()
        bucket = self._buckets.get(tenant) or _Bucket(float(self.free_burst), now)
        bucket.tokens = min(float(self.free_burst), bucket.tokens + (now - bucket.at) * self.free_per_second)
        bucket.at = now
        self._buckets[tenant] = bucket
        if len(self._buckets) > _PRUNE_AT:
            self._forget_full(now)
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return True
        return False

    def _forget_full(self, now: float) -> None:
        refill = self.free_burst / self.free_per_second if self.free_per_second > 0 else float("inf")
        self._buckets = {key: b for key, b in self._buckets.items() if now - b.at < refill}
