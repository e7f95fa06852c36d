"""Hang detection for model pools: the execution time limit Celery's threads pool does not enforce.

An op inside its handler for longer than `queue_config.execution_timeout` seconds fails its future with a
message saying so, and the worker exits with `PoolExit.HUNG`: a hung op cannot be interrupted safely from
another thread, and whatever it was doing to the model leaves the pool in an unknown state. The launcher
restores the queue's unacked messages (the failed op is then a terminal duplicate, skipped) and restarts the
worker; the adapters it held fail their next op with AdapterStateLost naming their last checkpoint.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from twinkle.errors import OpTimedOut
from twinkle.pool_exit import PoolExit
from workers.runtime import PoolRuntime

log = logging.getLogger("twinkle.watchdog")


class Watchdog:
    def __init__(self, runtime: PoolRuntime, timeout: float, *, poll: float | None = None) -> None:
        self.runtime = runtime
        self.timeout = timeout
        self.poll = poll if poll is not None else min(1.0, max(0.05, timeout / 10))

    def overdue(self, now: float | None = None) -> bool:
        running = self.runtime.current
        return running is not None and (now or time.monotonic()) - running.started > self.timeout

    def start(self) -> None:
        threading.Thread(target=self.run_forever, name="hang-watchdog", daemon=True).start()

    def run_forever(self) -> None:
        while True:
            time.sleep(self.poll)
            if self.overdue():
                self.expire()

    def expire(self) -> None:
        running = self.runtime.current
        if running is None:
            return
        rec = running.rec
        failure = OpTimedOut(
            f"{rec.op} ran longer than this pool's execution_timeout of {self.timeout:g} s and was "
            "abandoned; the pool is restarting.",
            hint="Retry with a smaller batch, or ask the operator to raise queue_config.execution_timeout.",
        )
        try:
            self.runtime.abandon_current(failure)
        except Exception:  # the broker may be down; exit anyway, the restart re-runs it
            log.exception("could not mark %s failed", rec.request_id)
        log.error("%s %s ran past %g s; exiting with code %d for a restart", rec.op, rec.request_id,
                  self.timeout, PoolExit.HUNG)
        logging.shutdown()
        os._exit(PoolExit.HUNG)
