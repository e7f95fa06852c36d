"""Status lines for people watching `twinkle-server launch`: one per pool, every ~30 s, only when it changed.

    [twinkle] pool model.models-tiny.0: ready, 3 adapters, queue 2
    [twinkle] pool sampler.sampler-tiny: loading model (45 s)

A pool is loading until its first heartbeat (the worker sends it once its model is loaded), ready while
the heartbeat is fresh, and restarting while its process is down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

import redis

from twinkle.keys import Keys
from twinkle.telemetry.resources import queue_depths

STATUS_SECONDS = 30.0


class PoolProcess(Protocol):
    queue: str | None
    started_at: float

    def alive(self) -> bool: ...


class PoolStatusPrinter:
    def __init__(self, r: redis.Redis, keys: Keys, *, interval: float = STATUS_SECONDS,
                 out: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.r = r
        self.keys = keys
        self.interval = interval
        self.out = out or (lambda line: print(line, flush=True))
        self.clock = clock
        self._due = clock() + interval
        self._last: dict[str, str] = {}

    def maybe_print(self, pools: Iterable[PoolProcess]) -> None:
        """Print the lines that changed, at most once per interval; never raises (the broker may be down)."""
        now = self.clock()
        if now < self._due:
            return
        self._due = now + self.interval
        try:
            lines = self.describe([p for p in pools if p.queue], now)
        except redis.RedisError:
            return
        for queue, line in lines.items():
            if line != self._last.get(queue) or " s)" in line:  # a pool still starting: show it is alive
                self.out(f"[twinkle] pool {queue}: {line}")
            self._last[queue] = line

    def describe(self, pools: list[PoolProcess], now: float) -> dict[str, str]:
        queues = [p.queue for p in pools if p.queue]
        depths = queue_depths(self.r, queues)
        pipe = self.r.pipeline(transaction=False)
        for queue in queues:
            pipe.exists(self.keys.pool_heartbeat(queue))
            pipe.scard(self.keys.pool_adapters(queue))
        replies = pipe.execute()
        lines: dict[str, str] = {}
        for i, pool in enumerate(p for p in pools if p.queue):
            queue = str(pool.queue)
            beating, adapters = replies[2 * i], int(replies[2 * i + 1])
            if not pool.alive():
                given_up = getattr(pool, "given_up", None)  # the launcher stopped retrying a failed start
                state = "failed to start, not retried" if given_up is not None and given_up() else "restarting"
            elif not beating:
                doing = "starting" if queue.startswith("processor.") else "loading model"
                state = f"{doing} ({now - pool.started_at:.0f} s)"
            else:
                state = "ready"
            parts = [state]
            if queue.startswith("model."):
                parts.append(f"{adapters} adapter{'s' if adapters != 1 else ''}")
            parts.append(f"queue {depths.get(queue, 0)}")
            lines[queue] = ", ".join(parts)
        return lines
