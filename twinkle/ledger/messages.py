"""A future's broker message: where it waits, what kombu's entries for it say, and putting it back at the head.

A queued op's message is in its pool's broker queue (a Redis list: producers LPUSH, consumers pop from the right
end, the head), in the queue's handover list (popped by the pool's consumer and not yet recorded,
workers/handover.py), parked in its key's backlog (twinkle.backlog) or behind a full-parameter run
(twinkle.pool_reservation), or delivered to its worker and not acknowledged yet. kombu's Redis transport keeps the
delivered ones in two keys shared by every queue of the database: `UNACKED`, a hash from delivery tag to the JSON
`[message, exchange, routing key]`, and `UNACKED_INDEX`, the tags by delivery time
(docs/celery_notes.md#unacked-messages-and-the-visibility-timeout). This module is the only one that reads them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from kombu.utils.json import dumps

from twinkle.backlog import BacklogKeys
from twinkle.futures import FutureRecord, FutureStatus, request_id_created_at
from twinkle.keys import Keys
from twinkle.ledger import scripts
from twinkle.ledger.call import Call, commands, script, text
from twinkle.ledger.sync_face import SyncLedger

UNACKED = "unacked"  # no key prefix: kombu's own
UNACKED_INDEX = "unacked_index"


def handover_key(queue: str) -> str:
    """The list a pool's consumer pops `queue`'s messages into before it records them (workers/handover.py)."""
    return f"twinkle.handover.{queue}"


@dataclass(frozen=True)
class Delivery:
    """One entry of the unacked hash: a message delivered to a worker and not acknowledged yet."""

    tag: bytes | str
    message: dict[str, Any]
    routing_key: str  # the queue it came from

    @property
    def request_id(self) -> str:
        """A Celery message's task id, which Twinkle makes the request id."""
        return str(self.message.get("headers", {}).get("id", ""))

    def body(self) -> str:
        """The message as a queue holds it."""
        return json.dumps(self.message)


@dataclass(frozen=True)
class Sighting:
    """Where a future's message was seen, in one read of every place it can be."""

    waiting: bool  # in its queue, its handover list, its key's backlog, or parked behind a full-parameter run
    delivered: bool  # in the unacked hash
    beat: dict[str, Any]  # the pool's heartbeat ({} when none): it names the ops its worker holds


def entry(message: bytes | str, exchange: str, routing_key: str) -> str:
    """The unacked entry of a delivered message (`message`: its JSON as the queue held it), in kombu's JSON as
    its own bookkeeping writes it. The message goes in as it came rather than decoded and encoded again, a second
    encoding per op of the whole message: kombu's producer and `twinkle.task_message` both write JSON with the
    encoder's default separators, so the bytes are those a second encoding would give."""
    text = message.decode() if isinstance(message, bytes) else message
    return f"[{text}, {dumps(exchange)}, {dumps(routing_key)}]"


# -- request ids out of messages, read on the Redis server --------------------------------------------------


def queue_ids(key: str, start: int, stop: int, created_before_ms: int) -> Call[list[str]]:
    """The request ids of the messages at LRANGE `start`..`stop` of a queue (or its handover list), head last;
    with `created_before_ms` > 0 only ids created before it."""
    return script(scripts.QUEUE_IDS, [key], [start, stop, created_before_ms],
                  lambda reply: [text(rid) for rid in reply])


def held_ids(cursor: str, count: int, created_before_ms: int, queues: Sequence[str]
             ) -> Call[tuple[str, list[tuple[int, str]]]]:
    """One HSCAN step over the unacked hash from `cursor`: the next cursor ("0" when done), and (index in `queues`,
    request id) of each entry routed to one of `queues` (created before `created_before_ms`, when > 0)."""
    def decode(reply: list[Any]) -> tuple[str, list[tuple[int, str]]]:
        return text(reply[0]), [(int(index) - 1, text(rid)) for index, rid in zip(reply[1::2], reply[2::2],
                                                                                  strict=True)]

    return script(scripts.HELD_IDS, [UNACKED], [cursor, count, created_before_ms, *queues], decode)


# -- reads ----------------------------------------------------------------------------------------------------


def sighting(keys: Keys, record: FutureRecord) -> Call[Sighting]:
    """Look for a queued or running record's message everywhere it can be, in the order a message moves (queue,
    handover list, unacked), so one that moves during the read is still seen."""
    rid = record.request_id
    needle = rid.encode()
    queued = record.state is FutureStatus.QUEUED
    places: list[tuple[Any, ...]] = [
        ("LRANGE", record.queue, 0, -1), ("LRANGE", handover_key(record.queue), 0, -1),
        ("LRANGE", BacklogKeys(keys).parked(record.queue, record.owner), 0, -1),
        ("LPOS", keys.reservation_parked_ids(record.queue), rid)] if queued else []

    def decode(replies: list[Any]) -> Sighting:
        *found, held, beat = replies
        waiting = False
        if found:
            in_queue, handed, parked, reserved = found
            waiting = (any(needle in raw for raw in [*in_queue, *handed])
                       or any(raw.startswith(needle + b" ") for raw in parked) or reserved is not None)
        return Sighting(waiting, any(needle in raw for raw in held), _beat(beat))

    return commands(*places, ("HVALS", UNACKED), ("GET", keys.pool_heartbeat(record.queue)), decode=decode)


def heartbeat(keys: Keys, queue: str) -> Call[dict[str, Any]]:
    """A pool's heartbeat: since when its worker runs, and the ops it holds ({} when none)."""
    return commands(("GET", keys.pool_heartbeat(queue)), decode=lambda replies: _beat(replies[0]))


def _beat(raw: bytes | None) -> dict[str, Any]:
    return json.loads(raw) if raw else {}


def deliveries_by_queue() -> Call[Counter[str]]:
    """How many delivered, unacknowledged messages each queue has (one read of the whole hash: it holds only what
    workers hold)."""
    return commands(("HVALS", UNACKED), decode=_count_by_queue)


def _count_by_queue(replies: list[Any]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for raw in replies[0]:
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        if isinstance(routing_key, str):
            counts[routing_key] += 1
    return counts


def delivered_before(cutoff: float) -> Call[list[bytes]]:
    """The tags of the entries delivered before `cutoff` (epoch seconds), oldest first."""
    return commands(("ZRANGEBYSCORE", UNACKED_INDEX, "-inf", cutoff), decode=lambda replies: list(replies[0]))


def delivery(tag: bytes | str) -> Call[Delivery | None]:
    """The entry of `tag` (None once it was acknowledged)."""
    return commands(("HGET", UNACKED, tag),
                    decode=lambda replies: _delivery(tag, replies[0]) if replies[0] is not None else None)


def _delivery(tag: bytes | str, raw: bytes) -> Delivery:
    message, _exchange, routing_key = json.loads(raw)
    return Delivery(tag, message, routing_key)


# -- writes ---------------------------------------------------------------------------------------------------


def record_delivery(queue: str, tag: str, unacked_entry: str, item: bytes, *, index_key: str = UNACKED_INDEX,
                    unacked_key: str = UNACKED) -> Call[int]:
    """A pool's consumer records a message it popped into `queue`'s handover list (`item`) as delivered, under
    kombu's own keys (a kombu channel's, which may name others), and drops it from the handover list, in one
    step; answers how many wait in `queue`."""
    return script(scripts.RECORD_DELIVERY, [index_key, unacked_key, handover_key(queue), queue],
                  [tag, time.time(), unacked_entry, item], int)


def ack(tag: str) -> Call[None]:
    """Acknowledge a delivered message, as kombu's Redis transport does."""
    return commands(("ZREM", UNACKED_INDEX, tag), ("HDEL", UNACKED, tag), decode=lambda _: None)


def drop_handed(queue: str, item: bytes) -> Call[None]:
    """Drop a message `queue`'s consumer popped into its handover list and will not run (not an op's)."""
    return commands(("LREM", handover_key(queue), 1, item), decode=lambda _: None)


def return_handover(queue: str) -> Call[int]:
    """Put what `queue`'s consumer popped and never recorded back at the head of the queue; answers how many."""
    return script(scripts.RETURN_HANDOVER, [handover_key(queue), queue], [], int)


def restore_orphan(found: Delivery, queue: str, *, fence_key: str = "", token: str = "") -> Call[bool]:
    """Put a delivered message back at the head of `queue`, unless it was acknowledged meanwhile or another worker
    holds the pool's lease (`fence_key` names another token; '' = no lease); whether it did."""
    return script(scripts.RESTORE_ORPHAN, [UNACKED, UNACKED_INDEX, queue, fence_key], [found.tag, found.body(), token],
                  lambda reply: bool(int(reply)))


def restore_unacked(r: redis.Redis, queue: str) -> int:
    """Put the unacked messages of a dead worker's queue back at the head of the queue, oldest first, behind
    them any message it popped but never recorded (workers/handover.py).

    Safe only while no consumer of `queue` is alive: each queue has exactly one consumer, and the
    supervisor calls this before it starts the replacement.
    """
    ledger = SyncLedger(r)
    handed = ledger.run(return_handover(queue))
    held: list[tuple[float, float, Delivery]] = []
    for tag, delivered in ledger.run(_deliveries()):
        found = ledger.run(delivery(tag))
        if found is None:
            ledger.run(commands(("ZREM", UNACKED_INDEX, tag), decode=lambda _: None))
            continue
        if found.routing_key == queue:
            # A pool holding many messages took several within one clock tick: their delivery times tie, and
            # the request ids' creation times keep them in acceptance order.
            held.append((delivered, request_id_created_at(found.request_id) or 0.0, found))
    for _, _, found in sorted(held, key=lambda h: (round(h[0], 2), h[1]), reverse=True):
        ledger.run(_restored(found, queue))  # RPUSH newest first, so the oldest ends up at the head
    return len(held) + handed


def _deliveries() -> Call[list[tuple[bytes, float]]]:
    """Every tag of the unacked index with its delivery time, oldest first."""
    def decode(replies: list[Any]) -> list[tuple[bytes, float]]:
        reply = replies[0]  # (tag, score) pairs, or flat on a client that leaves WITHSCORES replies as they come
        pairs = reply if reply and isinstance(reply[0], list | tuple) else zip(reply[::2], reply[1::2], strict=True)
        return [(tag, float(score)) for tag, score in pairs]

    return commands(("ZRANGE", UNACKED_INDEX, 0, -1, "WITHSCORES"), decode=decode)


def _restored(found: Delivery, queue: str) -> Call[None]:
    return commands(("RPUSH", queue, found.body()), ("HDEL", UNACKED, found.tag), ("ZREM", UNACKED_INDEX, found.tag),
                    decode=lambda _: None, atomic=True)
