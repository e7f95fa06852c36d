"""Keys that keep hammering after their 429s get those 429s slowly.

A refused request costs the API a whole pass through its stack (about a millisecond of CPU), so a client that
keeps many requests in flight and resends each one the moment its 429 arrives makes the API spend most of a
core on refusals, and every other tenant waits behind them in the event loop. The rate limit cannot help:
it refuses, it does not slow the sender.

So past `free_per_second` refusals of one key within a second, each further 429 of that key is held for
`penalty_seconds` before it goes out (its Retry-After shortened by as much). A client that keeps N requests in
flight then gets about N answers per penalty, whatever it does. A client that honours Retry-After (the Tinker
SDK does) gets a few refusals per second at most and never waits here; nothing that would be admitted is
ever delayed. At most `max_held` answers per key are held at once; beyond that they go out at once. The
counts are per API process and kept for the current second only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

PENALTY_SECONDS = 1.0
FREE_PER_SECOND = 50
MAX_HELD_PER_KEY = 64


class Tarpit:
    def __init__(self, penalty_seconds: float = PENALTY_SECONDS, *, free_per_second: int = FREE_PER_SECOND,
                 max_held: int = MAX_HELD_PER_KEY) -> None:
        self.penalty_seconds = penalty_seconds
        self.free_per_second = free_per_second
        self.max_held = max_held
        self._second = 0
        self._refused: Counter[str] = Counter()  # this second's refusals per key
        self._held: Counter[str] = Counter()

    async def refuse(self, tenant: str, retry_after: float) -> float:
        """Called as a 429 is about to go out to `tenant`; holds it when the key is hammering. Returns the
        Retry-After (seconds) to send."""
        second = math.floor(time.monotonic())
        if second != self._second:
            self._second, self._refused = second, Counter()
        self._refused[tenant] += 1
        if self.penalty_seconds <= 0 or self._refused[tenant] <= self.free_per_second \
                or self._held[tenant] >= self.max_held:
            return retry_after
        self._held[tenant] += 1
        try:
            await asyncio.sleep(self.penalty_seconds)
        finally:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]
        return max(0.001, retry_after - self.penalty_seconds)
