"""Adapter lifecycle on a model pool: unload adapters that went idle or outlived their lifetime.

An adapter is idle when neither its session heartbeated nor a request reached it for
`adapter_timeout` seconds; it expires regardless after `adapter_max_lifetime`. Unloading frees the
LoRA slot and the owner's model quota at once; ops still queued for it fail with the reason. An adapter
the API already released (its session finished, or it was unloaded) is dropped on the next sweep, without
waiting for the unload op behind whatever is queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from twinkle.keys import Keys
from twinkle.records import ModelRecord

log = logging.getLogger("twinkle.lifecycle")


class AdapterReaper:
    def __init__(self, r: redis.Redis, keys: Keys, *, adapter_ids: Callable[[], list[str]],
                 remove: Callable[[str], None], lock: threading.Lock, adapter_timeout: float,
                 max_lifetime: float, interval: float = 1.0) -> None:
        self.r = r
        self.keys = keys
        self.adapter_ids = adapter_ids
        self.remove = remove
        self.lock = lock
        self.adapter_timeout = adapter_timeout
        self.max_lifetime = max_lifetime
        self.interval = interval

    def expiry_reason(self, model: ModelRecord, now: float, last_heartbeat: float = 0.0) -> str | None:
        if self.max_lifetime > 0 and now - model.created_at > self.max_lifetime:
            return f"it reached the maximum adapter lifetime of {self.max_lifetime:g} s"
        if self.adapter_timeout <= 0:
            return None
        last_seen = max(last_heartbeat, model.last_request_at, model.created_at)
        if now - last_seen > self.adapter_timeout:
            return f"its session sent no heartbeat or request for {self.adapter_timeout:g} s"
        return None

    def sweep(self) -> list[str]:
        """One pass over the resident adapters: two pipelined reads however many there are (a pool holds up to
        `max_loras`, and a read each, every second, was a steady cost of its own), then the removals."""
        now = time.time()
        adapter_ids = self.adapter_ids()
        reads = self.r.pipeline(transaction=False)
        for adapter_id in adapter_ids:
            reads.hgetall(self.keys.model(adapter_id))
        hashes = reads.execute() if adapter_ids else []
        models = {adapter_id: ModelRecord.from_hash(raw) for adapter_id, raw in zip(adapter_ids, hashes, strict=True)
                  if raw}
        heartbeats = self._heartbeats([model for model in models.values() if model.status == "active"])
        expired = []
        for adapter_id in adapter_ids:
            model = models.get(adapter_id)
            if model is None:  # the broker lost its state (restart without persistence): nobody can reach it
                with self.lock:
                    self.remove(adapter_id)
                expired.append(adapter_id)
                log.warning("unloaded adapter %s: its record is gone from the broker", adapter_id)
                continue
            if model.status != "active":  # released by the API (session finished, unloaded): free it now
                with self.lock:
                    self.remove(adapter_id)
                expired.append(adapter_id)
                log.info("dropped adapter %s: %s", adapter_id, model.unload_reason or "unloaded")
                continue
            reason = self.expiry_reason(model, now, heartbeats.get(model.session_id, 0.0))
            if reason is None:
                continue
            with self.lock:
                self.remove(adapter_id)
            self.release(model, reason)
            expired.append(adapter_id)
            log.info("unloaded adapter %s: %s", adapter_id, reason)
        return expired

    def _heartbeats(self, models: list[ModelRecord]) -> dict[str, float]:
        """The last heartbeat of each of these adapters' sessions (0 when none), in one round trip."""
        if self.adapter_timeout <= 0 or not models:
            return {}
        sessions = sorted({model.session_id for model in models})
        reads = self.r.pipeline(transaction=False)
        for session_id in sessions:
            reads.hget(self.keys.session(session_id), "last_heartbeat")
        return {session_id: float(raw or 0) for session_id, raw in zip(sessions, reads.execute(), strict=True)}

    def release(self, model: ModelRecord, reason: str) -> None:
        pipe = self.r.pipeline()
        pipe.hset(self.keys.model(model.model_id), mapping={"status": "unloaded", "unload_reason": reason})
        pipe.srem(self.keys.owner_models(model.owner), model.model_id)
        pipe.srem(self.keys.pool_assigned(model.queue), model.model_id)
        pipe.execute()

    def run_forever(self) -> None:
        while True:
            try:
                self.sweep()
            except redis.RedisError as exc:
                log.warning("adapter sweep skipped: %s", exc)
            except Exception:
                log.exception("adapter sweep failed")
            time.sleep(self.interval)
