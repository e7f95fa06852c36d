"""A lost adapter's waiting ops end together, not one pool turn each.

A restarted pool no longer holds the adapters that lived in the worker before it; each of their ops fails with
`adapter_state_lost` at its turn. With thousands of them queued that is thousands of turns: a clock cycle each
(one adapter's ops never share one), and behind the pool's backlog, a release and a delivery each, while every
other tenant's ops wait their turns between them. So the first time a pool finds an adapter lost, every op of
that adapter waiting for this pool fails at once with the same error: in the broker queue, among the messages
this worker holds, and in the owner's backlog (taken out of it). Only ops accepted before the first op that
brings the adapter back (load_state) or ends it (create, unload) fail; samples never needed it. Their messages
that arrive later find their records terminal and are skipped without a turn (workers/runtime.py).

The oldest WAKE_BATCH fail at once, inside the turn that found the adapter lost (the ones this pool holds next
are among them); the rest on a thread of their own, paced (twinkle.queued_ops.WAKE_PAUSE), so that neither this
pool's turns nor the API's answers to everyone else wait while thousands of long-polls wake.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from twinkle.errors import TwinkleError
from twinkle.futures import FutureStatus, Op
from twinkle.queued_ops import BATCH, WAKE_BATCH, WAKE_PAUSE, Failure, QueuedOps

log = logging.getLogger("twinkle.worker")
# ops after which the adapter's state is no longer the lost one: later ops may succeed, or fail otherwise
TURNING_POINTS = frozenset({Op.LOAD_STATE, Op.CREATE_MODEL, Op.UNLOAD_MODEL})
NEEDS_NO_ADAPTER = frozenset({Op.SAMPLE})  # also spared by the runtime's adapter check


class LostAdapterOps:
    def __init__(self, ops: QueuedOps, queue: str) -> None:
        self.ops = ops
        self.queue = queue
        self.rest: threading.Thread | None = None  # failing the ops past the first WAKE_BATCH, paced

    def fail_waiting(self, model_id: str, owner: str, error: TwinkleError) -> int:
        """Fail the ops of `model_id` waiting for this pool up to its first turning point: the oldest now, the
        rest on a thread (joined by the thread this returns, if any). Returns how many ops it fails."""
        parked = {p.request_id for p in self.ops.parked(self.queue, owner) if p.model_id == model_id}
        ids = list(dict.fromkeys([*(rid for batch in self.ops.in_queue(self.queue) for rid in batch),
                                  *self.ops.held([self.queue])[self.queue], *parked]))
        doomed = self._before_turning_point(model_id, ids)
        if not doomed:
            return 0
        failure = Failure(str(error), error.code, error.category)
        began = time.monotonic()
        self._fail(model_id, owner, doomed[:WAKE_BATCH], failure, parked)
        if len(doomed) > WAKE_BATCH:
            self.rest = threading.Thread(target=self._fail_rest, name="lost-adapter-ops", daemon=True, args=(
                model_id, owner, doomed, failure, parked, began))
            self.rest.start()
        else:
            self._report(model_id, doomed, began)
        return len(doomed)

    def _fail_rest(self, model_id: str, owner: str, doomed: list[str], failure: Failure, parked: set[str],
                   began: float) -> None:
        try:
            time.sleep(WAKE_PAUSE)
            self._fail(model_id, owner, doomed[WAKE_BATCH:], failure, parked)
        except Exception:  # the broker is away: each fails at its own turn
            log.warning("could not fail the waiting ops of lost model %s together", model_id, exc_info=True)
            return
        self._report(model_id, doomed, began)

    def _fail(self, model_id: str, owner: str, ids: list[str], failure: Failure, parked: set[str]) -> None:
        failed = self.ops.fail(ids, failure, model_id=model_id, batch=WAKE_BATCH, pause=WAKE_PAUSE)
        self.ops.unpark(self.queue, owner, [rid for rid in failed if rid in parked])

    @staticmethod
    def _report(model_id: str, doomed: list[str], began: float) -> None:
        log.warning("model %s was lost with its worker: failed its %d waiting op(s) together in %.1f s", model_id,
                    len(doomed), time.monotonic() - began)

    def _before_turning_point(self, model_id: str, ids: list[str]) -> list[str]:
        waiting: list[tuple[float, str, str]] = []
        for start in range(0, len(ids), BATCH):
            batch = ids[start:start + BATCH]
            pipe = self.ops.r.pipeline(transaction=False)
            for rid in batch:
                pipe.hmget(self.ops.keys.future(rid), "model_id", "status", "op", "created_at")
            for rid, fields in zip(batch, pipe.execute(), strict=True):
                model, status, op, created = (_text(value) for value in fields)
                if model == model_id and status == FutureStatus.QUEUED:
                    waiting.append((float(created or 0), rid, op))
        doomed = []
        for _created, rid, op in sorted(waiting):  # acceptance order
            if op in TURNING_POINTS:
                break
            if op not in NEEDS_NO_ADAPTER:
                doomed.append(rid)
        return doomed


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else ("" if value is None else str(value))
