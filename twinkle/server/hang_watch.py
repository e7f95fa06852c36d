"""The launcher's watch over its pool workers from outside: a worker that froze is failed and replaced.

A worker's own hang watchdog (workers/watchdog.py) cannot act when the whole process is stopped (SIGSTOP)
or wedged in native code holding the interpreter. The launcher reads each worker's liveness file
(twinkle/liveness.py) and calls a worker hung when

- the op in its handler is past the pool's execution_timeout by GRACE_SECONDS (the worker's own watchdog
  would have acted by then), or
- the file has not been rewritten for STALL_SECONDS (the process is not running at all).

The op it was running then fails with `execution_timeout` (so its long-poll answers), and the supervisor
kills and restarts the worker, which puts the queue's unacked messages back first: queued ops run.
"""

from __future__ import annotations

import json
import logging
import time

import redis

from twinkle.broker import UNACKED
from twinkle.errors import OpTimedOut
from twinkle.keys import Keys
from twinkle.liveness import Liveness

log = logging.getLogger("twinkle.launcher")
GRACE_SECONDS = 3.0
STALL_SECONDS = 20.0  # far above any pause a live worker's one-second writer thread sees under load


class HangWatch:
    def __init__(self, r: redis.Redis, keys: Keys, *, stall_seconds: float = STALL_SECONDS,
                 grace_seconds: float = GRACE_SECONDS) -> None:
        self.r = r
        self.keys = keys
        self.stall_seconds = stall_seconds
        self.grace_seconds = grace_seconds

    def verdict(self, beat: Liveness, now: float | None = None) -> str:
        """Why the worker that wrote `beat` is hung ("" when it is not)."""
        now = time.time() if now is None else now
        silent = now - beat.t
        if beat.current and beat.execution_timeout > 0 and now - beat.started > beat.execution_timeout + \
                self.grace_seconds:
            return (f"{beat.op} ran {now - beat.started:.0f} s, past this pool's execution_timeout of "
                    f"{beat.execution_timeout:g} s")
        if silent > self.stall_seconds:
            return f"it showed no sign of life for {silent:.0f} s"
        return ""

    def fail_current(self, beat: Liveness, why: str, queue: str = "") -> int:
        """Fail the op the hung worker was running, where it is not terminal yet; wakes its long-polls.

        The liveness file can be a moment behind: a worker frozen right after it started an op, before its
        writer thread ran, still names the op before (finished) or none. So the ops of `queue` delivered to
        it and marked running fail too (a queue has one consumer: they are this worker's). Left running, one
        would be delivered again to the new worker and fail there as `adapter_state_lost`. Returns how many
        it failed."""
        running = dict.fromkeys(rid for rid in (beat.current, *self._running_on(queue)) if rid)
        return sum(self._fail(rid, beat.op if rid == beat.current else "", why) for rid in running)

    def _running_on(self, queue: str) -> list[str]:
        if not queue:
            return []
        ids = []
        for raw in self.r.hvals(UNACKED):  # type: ignore[union-attr]
            payload, _exchange, routing_key = json.loads(raw)
            if routing_key == queue and payload.get("headers", {}).get("id"):
                ids.append(str(payload["headers"]["id"]))
        statuses = [self.r.hget(self.keys.future(rid), "status") for rid in ids]
        return [rid for rid, status in zip(ids, statuses, strict=True) if status == b"running"]

    def _fail(self, rid: str, op: str, why: str) -> bool:
        error = OpTimedOut(f"{op or 'The op'} was abandoned because its worker hung ({why}); the pool "
                           "is restarting.",
                           hint="Retry it; if it hangs again, use a smaller batch or ask the operator to look "
                                "at the pool's log.")
        failed = self.r.eval(_FAIL_IF_PENDING, 1, self.keys.future(rid), time.time(), str(error), error.code,
                             self.keys.done_channel(rid))
        return bool(failed)


# KEYS: future. ARGV: now, error, code, done channel. Never creates a record, never overwrites an outcome.
_FAIL_IF_PENDING = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[2], 'category', 'server', 'code', ARGV[3],
           'finished_at', ARGV[1])
redis.call('PUBLISH', ARGV[4], 'failed')
return 1
"""
