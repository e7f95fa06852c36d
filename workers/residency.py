"""Which adapters sit in a model pool's LoRA slots, as Redis shows it to the API and to operators.

With paging (backends.paging) an adapter the pool holds may be resident (in a slot) or paged out to host
memory or disk. `pool_adapters(queue)` lists the resident ones: its size is the slots in use, and the API
reads it to tell a client whose op waits for a slot (`paused_capacity`). The pager's counters go to
`pool_paging(queue)`. Both are written only when they changed, so an op that pages nothing costs no
round trip. A backend without paging (megatron, data-parallel groups) reports every adapter it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from twinkle.backends.base import PagedAdapters
from twinkle.keys import Keys


class SlotResidency:
    def __init__(self, r: redis.Redis, keys: Keys, queue: str, backend: Any,
                 held: Callable[[], set[str]]) -> None:
        self.r = r
        self.keys = keys
        self.queue = queue
        self.backend = backend
        self.held = held  # every adapter the pool holds, resident or not
        self.paged = isinstance(backend, PagedAdapters)  # asked once: a Protocol's isinstance costs ~10 us
        self._published: set[str] = set()
        self._stats: dict[str, float] = {}
        pipe = r.pipeline()
        pipe.delete(keys.pool_adapters(queue), keys.pool_paging(queue))  # a (re)started pool holds nothing yet
        pipe.execute()

    def resident(self) -> set[str]:
        return set(self.backend.resident_adapters()) if self.paged else set(self.held())

    def publish(self) -> None:
        resident = self.resident()
        stats: dict[Any, Any] = self.backend.paging_stats() if self.paged else {}
        if resident == self._published and stats == self._stats:
            return
        key = self.keys.pool_adapters(self.queue)
        pipe = self.r.pipeline()
        if self._published - resident:
            pipe.srem(key, *(self._published - resident))
        if resident - self._published:
            pipe.sadd(key, *(resident - self._published))
        if stats != self._stats:
            pipe.hset(self.keys.pool_paging(self.queue), mapping=stats)
        pipe.execute()
        self._published, self._stats = resident, stats

    def after(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """The handler, publishing the residency once it ran (whether it succeeded or not)."""
        def run(*args: Any) -> Any:
            try:
                return handler(*args)
            finally:
                self.publish()

        return run
