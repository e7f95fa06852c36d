"""Exit codes a pool worker uses to ask its supervisor for a restart, and what each one means.

A worker that can no longer trust its in-memory state exits at once (no warm shutdown: the op in flight
stays unacked, the launcher puts it back at the head of the queue, and the restarted worker fails it with
AdapterStateLost naming the adapter's last checkpoint).
"""

from __future__ import annotations

from enum import IntEnum


class PoolExit(IntEnum):
    RANK_DIED = 75  #: a rank actor of the pool's Ray device group died
    HUNG = 76  #: an op ran past queue_config.execution_timeout
    START_FAILED = 77  #: it could not start (its model did not load, ...); the cause is in its cause file
    LEASE_LOST = 78  #: another worker took its queue's lease (twinkle/pool_lease.py); a restart waits for that one

    @property
    def reason(self) -> str:
        return _REASONS[self]


_REASONS = {
    PoolExit.RANK_DIED: "a rank of its Ray device group died",
    PoolExit.HUNG: "an op ran past its execution_timeout",
    PoolExit.START_FAILED: "it failed to start",
    PoolExit.LEASE_LOST: "another worker took over its pool queue; a restart is refused while that one holds it",
}


def exit_reason(code: int | None) -> str:
    """Why a worker exited with `code`, for the supervisor's log line ("" when the code is not ours)."""
    try:
        return PoolExit(code).reason if code is not None else ""
    except ValueError:
        return ""
