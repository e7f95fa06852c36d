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

import logging
import time
from collections.abc import Callable

import redis

from twinkle.ledger import SyncLedger, messages
from twinkle.pool_lease import PoolLease

log = logging.getLogger("twinkle.worker")
MIN_AGE_SECONDS = 5.0


class OrphanSweep:
    def __init__(self, r: redis.Redis, queue: str, held: Callable[[], set[str]], *,
                 min_age: float = MIN_AGE_SECONDS, lease: PoolLease | None = None) -> None:
        self.ledger = SyncLedger(r)
        self.lease = lease
        self.queue = queue
        self.held = held  # task ids the worker has reserved or is running
        self.min_age = min_age

    def sweep(self) -> int:
        """Put this queue's orphans back; returns how many."""
        tags = self.ledger.run(messages.delivered_before(time.time() - self.min_age))
        if not tags:
            return 0
        held = self.held()
        restored = 0
        for tag in reversed(tags):  # RPUSH newest first, so the oldest ends up at the head
            found = self.ledger.run(messages.delivery(tag))
            if found is None or found.routing_key != self.queue or found.request_id in held:
                continue
            fence_key, token = (self.lease.fence_key, self.lease.token) if self.lease is not None else ("", "")
            restored += self.ledger.run(messages.restore_orphan(found, self.queue, fence_key=fence_key, token=token))
        if restored:
            log.warning("put %d orphaned unacked message(s) back at the head of %s", restored, self.queue)
        return restored

