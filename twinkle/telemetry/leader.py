"""The cleanup leader: the one worker process that publishes server-wide gauges.

Every model and sampler worker is a candidate. The leader holds a Redis lease (a key with a TTL that only
its holder renews); when it dies the lease expires and another candidate takes over within one TTL.
Server-wide values (`twinkle.{sessions,models,sampling_sessions,futures}.active`, `twinkle.queue.depth`)
are published by the leader alone, so dashboards never add up copies from several processes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis

from twinkle.keys import Keys
from twinkle.telemetry import naming
from twinkle.telemetry.resources import ResourceCounts, count_resources, queue_depths

log = logging.getLogger("twinkle.telemetry")
LEASE_SECONDS = 15.0

# KEYS: lease. ARGV: holder, ttl ms. Returns 1 while the caller holds the lease (renewed), else 0.
_HOLD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# KEYS: lease. ARGV: holder. Gives the lease up only if the caller still holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lease_key(keys: Keys) -> str:
    return f"{keys.root}telemetry:cleanup-leader"


class CleanupLeader:
    def __init__(self, r: redis.Redis, keys: Keys, *, lease_seconds: float = LEASE_SECONDS,
                 holder: str | None = None) -> None:
        self.r = r
        self.key = lease_key(keys)
        self.lease_seconds = lease_seconds
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.is_leader = False
        self._hold = r.register_script(_HOLD)
        self._release = r.register_script(_RELEASE)
        self._stop = threading.Event()

    def try_lead(self) -> bool:
        """Take or renew the lease; True while this process leads."""
        try:
            held = bool(self._hold(keys=[self.key], args=[self.holder, int(self.lease_seconds * 1000)]))
        except redis.RedisError:
            held = False  # the broker is down: nobody can be sure to lead, so stop publishing
        if held and not self.is_leader:
            log.info("became cleanup leader (%s)", self.holder)
        elif self.is_leader and not held:
            log.warning("lost cleanup leadership (%s)", self.holder)
        self.is_leader = held
        return held

    def run_forever(self) -> None:
        while not self._stop.is_set():
            self.try_lead()
            self._stop.wait(self.lease_seconds / 3)

    def start(self) -> CleanupLeader:
        self.try_lead()
        threading.Thread(target=self.run_forever, name="cleanup-leader", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.is_leader:
            try:
                self._release(keys=[self.key], args=[self.holder])
            except redis.RedisError:
                pass  # the lease expires on its own
            self.is_leader = False


class ServerGauges:
    """The leader's observable gauges; each collection reads Redis at most once per `min_interval`."""

    def __init__(self, r: redis.Redis, keys: Keys, queues: Iterable[str], *, leader: CleanupLeader | None = None,
                 min_interval: float = 1.0) -> None:
        self.leader = leader
        self.r = r
        self.keys = keys
        self.queues = list(queues)
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._read_at = -1e18
        self._counts: ResourceCounts | None = None
        self._depths: dict[str, int] = {}

    def register(self, meter: Any) -> ServerGauges:
        from opentelemetry.metrics import Observation

        def resource(field: str) -> Any:
            def observe(_options: Any) -> Iterator[Any]:
                counts = self._read()[0]
                if counts is not None:
                    yield Observation(getattr(counts, field))
            return observe

        def depth(_options: Any) -> Iterator[Any]:
            for queue, value in self._read()[1].items():
                yield Observation(value, {"queue": queue, "deployment": naming.deployment_of_queue(queue)})

        for field in ("sessions", "models", "sampling_sessions", "futures"):
            meter.create_observable_gauge(f"twinkle.{field}.active", callbacks=[resource(field)],
                                          description=f"Live {field.replace('_', ' ')} on the server")
        meter.create_observable_gauge("twinkle.queue.depth", callbacks=[depth],
                                      description="Ops waiting or running per pool queue")
        return self

    def _read(self) -> tuple[ResourceCounts | None, dict[str, int]]:
        if self.leader is None or not self.leader.is_leader:
            return None, {}
        with self._lock:
            if time.monotonic() - self._read_at >= self.min_interval:
                try:
                    self._counts = count_resources(self.r, self.keys)
                    self._depths = queue_depths(self.r, self.queues)
                except redis.RedisError as exc:
                    log.warning("could not read server gauges: %s", exc)
                    self._counts, self._depths = None, {}
                self._read_at = time.monotonic()
            return self._counts, dict(self._depths)
