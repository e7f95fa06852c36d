"""Unacked messages a pool's own consumer forgot, put back at the head of its queue while it runs.

kombu keeps a delivered message in the `unacked` hash until its ack. When the broker goes away, the
consumer drops its channel and tries to put that channel's unacked messages back, which fails while Redis
is down; after reconnecting, its new channel knows nothing of them, and they would wait for the visibility
timeout (hours), their futures queued all that time. Each queue has exactly one consumer, so an entry
routed to our queue that our worker neither holds nor runs, delivered more than MIN_AGE_SECONDS ago (a
fresh delivery is registered within milliseconds), is an orphan: it goes back at the head, oldest first.
A re-delivered op that had already finished is skipped by the runtime as a duplicate. A worker that lost its
pool lease (twinkle/pool_lease.py) puts nothing back: the queue's unacked entries are another consumer's now.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis

from twinkle.broker import UNACKED, UNACKED_INDEX
from twinkle.pool_lease import PoolLease

log = logging.getLogger("twinkle.worker")
MIN_AGE_SECONDS = 5.0


class OrphanSweep:
    def __init__(self, r: redis.Redis, queue: str, held: Callable[[], set[str]], *,
                 min_age: float = MIN_AGE_SECONDS, lease: PoolLease | None = None) -> None:
        self.r = r
        self.lease = lease
        self.queue = queue
        self.held = held  # task ids the worker has reserved or is running
        self.min_age = min_age
        self._restore = r.register_script(_RESTORE)

    def sweep(self) -> int:
        """Put this queue's orphans back; returns how many."""
        tags: list[bytes] = self.r.zrangebyscore(UNACKED_INDEX, "-inf", time.time() - self.min_age)  # type: ignore[assignment]
        if not tags:
            return 0
        held = self.held()
        restored = 0
        for tag in reversed(tags):  # RPUSH newest first, so the oldest ends up at the head
            raw = self.r.hget(UNACKED, tag)
            if raw is None:
                continue
            payload, _exchange, routing_key = json.loads(raw)
            if routing_key != self.queue or payload.get("headers", {}).get("id") in held:
                continue
            fence = [self.lease.fence_key, self.lease.token] if self.lease is not None else ["", ""]
            restored += int(self._restore(keys=[UNACKED, UNACKED_INDEX, self.queue, fence[0]],
                                          args=[tag, json.dumps(payload), fence[1]]))
        if restored:
            log.warning("put %d orphaned unacked message(s) back at the head of %s", restored, self.queue)
        return restored


# KEYS: unacked, unacked_index, queue, pool lease fence ('' = none). ARGV: tag, message, lease token. Atomic, and
# a no-op when it was acked meanwhile or another worker took the queue's lease.
_RESTORE = """
if KEYS[4] ~= '' then
  local fence = redis.call('GET', KEYS[4])
  if fence and fence ~= ARGV[3] then return 0 end
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
