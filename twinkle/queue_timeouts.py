"""Queued ops fail by `queue_config.queue_timeout` while still queued, wherever their message waits.

A pool fails an op that waited past its queue_timeout when it picks the op up (workers/runtime.py). An op behind
a frozen or dead worker, or deep in a backlog, would wait for that pick-up, and its long-poll with it. So the
API processes sweep every pool queue about once a second: ops created more than queue_timeout + MARGIN_SECONDS
ago whose records are still `queued` fail with code `queue_timeout`, and their long-polls answer at once, whether
the message is in the broker queue, held by the worker (kombu's unacked hash), or parked in its key's backlog
(taken out of it). A message that arrives at a worker later finds its record terminal and is skipped.

Why the API: every deployment runs one where clients poll, whichever node runs the pools, so ops of a pool whose
node is down time out too. One API process sweeps a round (a lock that expires with the round). The fail is
one atomic script that writes only records still `queued` (twinkle.ledger.queued), so it never overwrites an op a
worker began; MARGIN_SECONDS keeps the sweep behind the worker's own check at pick-up, which fails the op as
soon as it is past its timeout, so the two never decide differently about an op being begun.

Cost: ids are read on the Redis server (about 6 us per queued message, and backlogs are read from their oldest
end only as far as ops are old enough); rounds are spaced so that sweeping takes at most DUTY of the time. Ops
are failed WAKE_BATCH at a time, paced, as their long-polls wake (twinkle.queued_ops).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import redis

from twinkle.catalog import Catalog
from twinkle.errors import QueueTimedOut
from twinkle.keys import Keys
from twinkle.queued_ops import WAKE_BATCH, WAKE_PAUSE, Failure, QueuedOps

if TYPE_CHECKING:
    from twinkle.config.apps import ModelApp, SamplerApp
    from twinkle.config.server_config import ServerConfig

log = logging.getLogger("twinkle.queue_timeouts")
SWEEP_SECONDS = 1.0
MARGIN_SECONDS = 2.0  # behind the worker's check at pick-up (and clocks of different nodes)
DUTY = 0.03  # at most this share of the time spent sweeping: large queues are swept less often


def queue_timeout_error(op: str, waited: str, queue: str, timeout: float) -> QueueTimedOut:
    return QueueTimedOut(
        f"{op} waited {waited} s in the queue of {queue}, longer than its queue_timeout of {timeout:g} s, and was "
        "not run.",
        hint="Submit it again when the server is less busy, or ask the operator to raise queue_config.queue_timeout.")


def timeouts_by_queue(config: ServerConfig, catalog: Catalog) -> dict[str, float]:
    """The queue_timeout of every model and sampler pool queue (processor ops never time out in their queue)."""
    out: dict[str, float] = {}
    pools: list[ModelApp | SamplerApp] = [*config.model_apps(), *config.sampler_apps()]
    for app in pools:
        served = catalog.by_app(app.name)
        if served is None:
            continue
        queues = served.model_queues if app.name == served.model_app else [served.sampler_queue]
        for queue in queues:
            if queue and app.args.queue_config.queue_timeout > 0:
                out[queue] = float(app.args.queue_config.queue_timeout)
    return out


class QueueTimeoutSweep:
    def __init__(self, r: Any, keys: Keys, timeouts: dict[str, float], *, ttl: int) -> None:
        self.r = r
        self.ops = QueuedOps(r, keys, ttl=ttl)
        self.timeouts = {queue: timeout for queue, timeout in timeouts.items() if timeout > 0}
        self.lock_key = f"{keys.root}queue_timeouts:sweeping"

    def sweep(self, now: float | None = None) -> int:
        """Fail every op past its queue's timeout that is still queued; returns how many."""
        now = time.time() if now is None else now
        cutoffs = {queue: now - timeout - MARGIN_SECONDS for queue, timeout in self.timeouts.items()}
        if not cutoffs:
            return 0
        held = self.ops.held(cutoffs, created_before=max(cutoffs.values()))
        failed = 0
        for queue, cutoff in cutoffs.items():
            failure = self._failure(queue)
            ids = [*held[queue], *(rid for batch in self.ops.in_queue(queue, created_before=cutoff) for rid in batch)]
            failed += len(self.ops.fail(ids, failure, created_before=cutoff, batch=WAKE_BATCH, pause=WAKE_PAUSE))
            for tenant in self.ops.waiting_tenants(queue):
                parked = [p.request_id for p in self.ops.parked(queue, tenant, created_before=cutoff)]
                ended = self.ops.fail(parked, failure, created_before=cutoff, batch=WAKE_BATCH, pause=WAKE_PAUSE)
                self.ops.unpark(queue, tenant, ended)
                failed += len(ended)
        if failed:
            log.warning("%d queued op(s) failed by their queue_timeout", failed)
        return failed

    def _failure(self, queue: str) -> Failure:
        error = queue_timeout_error("{op}", "{waited}", queue, self.timeouts[queue])  # filled in per record
        return Failure(str(error), error.code, error.category)

    def my_round(self) -> bool:
        """Whether this process sweeps this round (one process of all that share the broker does)."""
        return bool(self.r.set(self.lock_key, "1", nx=True, px=int(SWEEP_SECONDS * 1000) - 100))

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            began = time.monotonic()
            try:
                if self.my_round():
                    self.sweep()
            except redis.RedisError:
                pass  # the broker is away: the next round sweeps
            except Exception:  # a sweep that failed once must not stop the next
                log.exception("queue_timeout sweep failed; trying again")
            stop.wait(max(SWEEP_SECONDS, (time.monotonic() - began) / DUTY))

    def start(self) -> threading.Event:
        """Sweep on a thread of its own from now on (its Redis calls never block an event loop); set the event
        it returns to stop."""
        stop = threading.Event()
        if self.timeouts:
            threading.Thread(target=self.run_forever, args=(stop,), name="queue-timeouts", daemon=True).start()
        return stop
