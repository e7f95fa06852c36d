"""The launcher's watch over its pool workers from outside: a worker that froze is failed and replaced.

A worker's own hang watchdog (workers/watchdog.py) cannot act when the whole process is stopped (SIGSTOP)
or wedged in native code holding the interpreter. The launcher reads each worker's liveness file
(twinkle/liveness.py) and calls a worker hung when

- the op in its handler is past the pool's execution_timeout by GRACE_SECONDS (the worker's own watchdog
  would have acted by then), or
- an op of its model pool's queue is marked running on its record (the runtime's begin script writes the start
  time), began after this worker process started, is past execution_timeout by GRACE_SECONDS, and the file was
  not rewritten since the op was due to end: a worker frozen right after it began an op, before its writer
  thread named the op (the file then names the op before, or none), or
- the file has not been rewritten for STALL_SECONDS (the process is not running at all).

The running ops of a queue are the ones its worker holds (kombu's unacked hash, read on the Redis server,
twinkle.queued_ops) whose records say `running`; their records are read, and failed, through the ledger
(twinkle.ledger.lifecycle). They are read only while the file is silent, so a live worker
costs the broker nothing, and an outage of Redis never looks like a hang (no records, no verdict from them).

The op it was running then fails with `execution_timeout` (so its long-poll answers), and the supervisor
kills and restarts the worker, which puts the queue's unacked messages back first: queued ops run.
"""

from __future__ import annotations

import logging
import socket
import time

import redis

from twinkle.errors import OpTimedOut
from twinkle.keys import Keys
from twinkle.ledger import SyncLedger, lifecycle
from twinkle.liveness import Liveness
from twinkle.pool_lease import read_holder
from twinkle.queued_ops import QueuedOps

log = logging.getLogger("twinkle.launcher")
GRACE_SECONDS = 3.0
STALL_SECONDS = 20.0  # far above any pause a live worker's one-second writer thread sees under load
RECORD_CHECK_SECONDS = 0.5  # how often a silent worker's running ops are read from their records


def enforces_execution_timeout(queue: str) -> bool:
    """Model pools run one op (or one clock cycle) at a time under their own watchdog (workers/watchdog.py), so an
    op of theirs past execution_timeout is hung; sampler and processor pools run ops side by side, unbounded."""
    return queue.startswith("model.")  # twinkle.catalog.model_queue


class HangWatch:
    def __init__(self, r: redis.Redis, keys: Keys, *, stall_seconds: float = STALL_SECONDS,
                 grace_seconds: float = GRACE_SECONDS, record_check_seconds: float = RECORD_CHECK_SECONDS) -> None:
        self.r = r
        self.keys = keys
        self.stall_seconds = stall_seconds
        self.grace_seconds = grace_seconds
        self.record_check_seconds = record_check_seconds
        self.ops = QueuedOps(r, keys, ttl=0)  # reads only
        self.ledger = SyncLedger(r)
        self._records_read: dict[str, float] = {}  # queue -> when its running ops were last read (monotonic)

    def verdict(self, beat: Liveness, now: float | None = None, *, queue: str = "", since: float = 0.0) -> str:
        """Why the worker that wrote `beat` is hung ("" when it is not). With `queue`, its pool's queue, and
        `since`, when the worker process started, the records of the ops it runs count too."""
        now = time.time() if now is None else now
        silent = now - beat.t
        if beat.current and beat.execution_timeout > 0 and now - beat.started > beat.execution_timeout + \
                self.grace_seconds:
            return (f"{beat.op} ran {now - beat.started:.0f} s, past this pool's execution_timeout of "
                    f"{beat.execution_timeout:g} s")
        if queue and silent > self.grace_seconds and beat.execution_timeout > 0 and enforces_execution_timeout(queue):
            overdue = self._overdue_running_op(beat, queue, now, since)
            if overdue:
                return overdue
        if silent > self.stall_seconds:
            return f"it showed no sign of life for {silent:.0f} s"
        return ""

    def _overdue_running_op(self, beat: Liveness, queue: str, now: float, since: float) -> str:
        """An op its record says this worker runs, past its limit, with no sign of life from the worker since the
        op was due to end ("" when none, or when the broker cannot tell now)."""
        if time.monotonic() - self._records_read.get(queue, -self.record_check_seconds) < self.record_check_seconds:
            return ""
        self._records_read[queue] = time.monotonic()
        limit = beat.execution_timeout
        try:
            ids = list(dict.fromkeys([*([beat.current] if beat.current else []), *self.ops.held([queue])[queue]]))
            running = self.ledger.run(lifecycle.running(self.keys, ids))
        except redis.RedisError:
            return ""  # no records now; the liveness file's rules still hold
        for rid, began in running.items():
            started = began.started_at
            if started >= since and now - started > limit + self.grace_seconds and beat.t < started + limit:
                name = began.op or "an op"
                return (f"{name} {rid} began {now - started:.0f} s ago, past this pool's execution_timeout of "
                        f"{limit:g} s, and the worker showed no sign of life since")
        return ""

    def fail_current(self, beat: Liveness, why: str, queue: str = "") -> int:
        """Fail the op the hung worker was running, where it is not terminal yet; wakes its long-polls.

        The liveness file can be a moment behind: a worker frozen right after it started an op, before its
        writer thread ran, still names the op before (finished) or none. So the ops of `queue` delivered to
        it and marked running fail too (a queue has one consumer: they are this worker's). Left running, one
        would be delivered again to the new worker and fail there as `adapter_state_lost`. Returns how many
        it failed. Once another worker took the queue's lease (this one froze past it), the queue's running ops
        are that worker's: only the op the hung worker itself names fails."""
        others = [] if self._lease_taken_from(beat.pid, queue) else self._running_on(queue)
        running = dict.fromkeys(rid for rid in (beat.current, *others) if rid)
        return sum(self._fail(rid, beat.op if rid == beat.current else "", why) for rid in running)

    def _lease_taken_from(self, pid: int, queue: str) -> bool:
        if not queue:
            return False
        holder = read_holder(self.r, self.keys.pool_lease(queue))
        return holder is not None and not (holder.pid == pid and holder.host == socket.gethostname())

    def _running_on(self, queue: str) -> list[str]:
        if not queue:
            return []
        running = self.ledger.run(lifecycle.running(self.keys, self.ops.held([queue])[queue]))
        return list(running)

    def _fail(self, rid: str, op: str, why: str) -> bool:
        error = OpTimedOut(f"{op or 'The op'} was abandoned because its worker hung ({why}); the pool "
                           "is restarting.",
                           hint="Retry it; if it hangs again, use a smaller batch or ask the operator to look "
                                "at the pool's log.")
        return self.ledger.run(lifecycle.fail_if_pending(self.keys, rid, str(error), error.code))

