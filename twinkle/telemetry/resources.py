"""Server-wide counts read from Redis: live resources and queue depths.

Both are cheap enough to read every export interval: one SCAN pass per resource kind (pipelined HGETs,
no values loaded) and one LLEN per queue plus one read of kombu's small unacked hash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from twinkle.keys import Keys
from twinkle.ledger import messages

SCAN_BATCH = 1000
Keep = Callable[[bytes | None], bool]


@dataclass(frozen=True)
class ResourceCounts:
    sessions: int  # not finished and still heartbeating (expired sessions are gone from Redis)
    models: int  # adapters whose model record is active
    sampling_sessions: int
    futures: int  # queued or running


def count_resources(r: redis.Redis, keys: Keys) -> ResourceCounts:
    return ResourceCounts(
        sessions=_count(r, f"{keys.root}session:*", "finished", lambda v: not v),
        models=_count(r, f"{keys.root}model:*", "status", lambda v: v == b"active"),
        sampling_sessions=_count(r, f"{keys.root}sampling:*", None, None),
        futures=_count(r, f"{keys.root}future:*", "status", lambda v: v in (b"queued", b"running")),
    )


def _count(r: redis.Redis, pattern: str, field: str | None, keep: Keep | None) -> int:
    total = 0
    batch: list[bytes] = []
    for key in r.scan_iter(match=pattern, count=SCAN_BATCH, _type="HASH"):
        batch.append(key)
        if len(batch) >= SCAN_BATCH:
            total += _count_batch(r, batch, field, keep)
            batch = []
    return total + _count_batch(r, batch, field, keep)


def _count_batch(r: redis.Redis, batch: list[bytes], field: str | None, keep: Keep | None) -> int:
    if field is None or keep is None or not batch:
        return len(batch)
    pipe = r.pipeline(transaction=False)
    for key in batch:
        pipe.hget(key, field)
    return sum(1 for value in pipe.execute() if keep(value))


def queue_depths(r: redis.Redis, queues: Iterable[str]) -> dict[str, int]:
    """Messages per Celery queue: waiting in the queue's list plus delivered but not yet acked (running)."""
    names = list(queues)
    pipe = r.pipeline(transaction=False)
    for queue in names:
        pipe.llen(queue)
    delivered = messages.deliveries_by_queue()
    delivered.stage(pipe)
    *lengths, held = pipe.execute()
    depths = dict(zip(names, (int(n) for n in lengths), strict=True))
    for queue, count in delivered.decode([held]).items():
        if queue in depths:
            depths[queue] += count
    return depths
