"""Queued ops where the broker holds them, and failing them while they are still queued.

A queued op's message is in one of three places: its pool's broker queue (a Redis list, newest at the head, and
its handover list: popped by the pool's consumer, not yet recorded, workers/handover.py), delivered to its worker
and not acknowledged yet (kombu's `unacked` hash: the ops a worker holds, running or waiting for their turn), or
parked in its key's backlog (twinkle.backlog). The ledger's scripts (twinkle.ledger.messages) read request ids
out of those places on the Redis server, BATCH entries a call (a message is about a kilobyte of JSON, its id
30 bytes), optionally only ids created before a time (a request id starts with its creation time), so a scan
costs Redis about 6 us an entry and moves only ids.

Failing is one script per batch (twinkle.ledger.queued) that writes only records still `queued`: a running or
terminal record is never overwritten (the worker that began the op first wins), and a later delivery of a failed op's
message finds its record terminal and is skipped (workers/runtime.py). Its long-polls wake at once (the done
channel).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from twinkle.backlog import BacklogKeys, Parked
from twinkle.keys import Keys
from twinkle.ledger import SyncLedger, messages, queued

BATCH = 500  # entries a script call reads or writes: a few ms of Redis at most
# Failing thousands of ops at once wakes thousands of long-polls at once, and an API process then answers them
# ahead of every other request (2,000 at once: other tenants' step p99 13x for 3 s, on 2 busy cores). Paced at
# WAKE_BATCH per WAKE_PAUSE (500 a second, what one API process answers there) 2,000 end as soon (4 s) and the
# others' p99 stays within 2x (bench/faults.py --frozen-backlog).
WAKE_BATCH = 50
WAKE_PAUSE = 0.1


@dataclass(frozen=True)
class Failure:
    """What failing an op writes on its record. `error` may name `{op}` and `{waited}` (whole seconds since it
    was accepted), filled in per record by the script."""

    error: str
    code: str
    category: str = "server"


def created_ms(request_id: str) -> int:
    """The creation time a request id starts with, in ms (0 when it has none: then only its record can tell)."""
    head, _, tail = request_id.partition("-")
    try:
        return int(head, 16) if tail and len(head) <= 12 else 0
    except ValueError:
        return 0


class QueuedOps:
    def __init__(self, r: Any, keys: Keys, *, ttl: int) -> None:
        self.r = r
        self.ledger = SyncLedger(r)
        self.keys = keys
        self.backlog = BacklogKeys(keys)
        self.ttl = ttl  # a failed record lives as long as a finished one

    # -- where they are ----------------------------------------------------------------------------

    def in_queue(self, queue: str, *, created_before: float = 0.0) -> Iterator[list[str]]:
        """Batches of the request ids in the broker queue (and its handover list), oldest first; with
        `created_before` (epoch seconds) only ids created before it. Messages pushed or popped meanwhile may
        shift a batch: a periodic sweep sees them the next time."""
        before_ms = int(created_before * 1000)
        for key in (messages.handover_key(queue), queue):
            length = int(self.r.llen(key))
            for end in range(-1, -length - 1, -BATCH):
                ids = self.ledger.run(messages.queue_ids(key, end - BATCH + 1, end, before_ms))
                yield ids[::-1]

    def held(self, queues: Iterable[str], *, created_before: float = 0.0) -> dict[str, list[str]]:
        """The request ids each of `queues` has in the unacked hash (delivered to its worker, not acknowledged)."""
        names = list(queues)
        out: dict[str, list[str]] = {name: [] for name in names}
        if not names:
            return out
        cursor = "0"
        while True:
            cursor, found = self.ledger.run(messages.held_ids(cursor, BATCH, int(created_before * 1000), names))
            for index, request_id in found:
                out[names[index]].append(request_id)
            if cursor == "0":
                return out

    def parked(self, queue: str, tenant: str, *, created_before: float = 0.0) -> list[Parked]:
        """The key's parked ops, oldest first; with `created_before`, the ones at its head created before it (a
        backlog is in acceptance order, so the scan stops at the first younger one)."""
        key = self.backlog.parked(queue, tenant)
        before_ms = int(created_before * 1000)
        out: list[Parked] = []
        start = 0
        while True:
            items = [Parked.decode(raw) for raw in self.r.lrange(key, start, start + BATCH - 1)]
            for item in items:
                if before_ms and created_ms(item.request_id) >= before_ms:
                    return out
                out.append(item)
            if len(items) < BATCH:
                return out
            start += BATCH

    def waiting_tenants(self, queue: str) -> list[str]:
        return sorted(_text(m) for m in self.r.smembers(self.backlog.waiting(queue)))

    # -- failing them ------------------------------------------------------------------------------

    def fail(self, request_ids: list[str], failure: Failure, *, created_before: float = 0.0, model_id: str = "",
             batch: int = BATCH, pause: float = 0.0) -> list[str]:
        """Fail the records of `request_ids` that are still queued (and created before `created_before`, of
        `model_id`, when given) in one atomic step per `batch`, `pause` seconds apart; returns the ids failed."""
        failed: list[str] = []
        for start in range(0, len(request_ids), batch):
            if start and pause:
                time.sleep(pause)
            ids = request_ids[start:start + batch]
            failed += [ids[p] for p in self.ledger.run(queued.fail_queued(
                self.keys, ids, error=failure.error, code=failure.code, category=failure.category, ttl=self.ttl,
                created_before=created_before, model_id=model_id))]
        return failed

    def unpark(self, queue: str, tenant: str, request_ids: list[str]) -> int:
        """Take `request_ids` out of the key's backlog (their records ended): nothing sends them later. Returns
        how many were there."""
        removed = 0
        for start in range(0, len(request_ids), BATCH):
            removed += self.ledger.run(queued.unpark(self.backlog, queue, tenant, request_ids[start:start + BATCH]))
        return removed


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
