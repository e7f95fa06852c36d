"""Continuous batching for a sampler pool.

The sampler pool consumes several sample tasks at once (Celery threads, one per slot); each task
thread hands its request to the batcher and waits. One generation thread serves them:
- a sampler with `serve(take)` (the torch sampler) runs one continuous generation that calls `take`
  between decode steps, so a request arriving mid-generation joins it instead of waiting for it to end
  (a generation starts once a burst of arrivals has paused for a few ms, at most 30 ms);
- any other takes everything waiting (up to `max_batch` requests) into one `sampler.sample(batch)` call.
Either way requests for different adapters share one batched generation.

At most `max_batch` requests are handed to the sampler at once; the others wait here, and the next to go is
chosen by weighted fair share between tenants (`workers.fair_share`), so one tenant's burst of requests does
not keep everyone else's out of the generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from twinkle.backends.base import ContinuousSampling
from twinkle.futures import Op
from twinkle.types import SampleOutput, SampleRequest
from workers.fair_share import FairShare, op_cost

log = logging.getLogger("twinkle.batcher")


@dataclass
class _Waiting:
    request: SampleRequest
    done: Future[SampleOutput]
    tenant: str
    weight: float
    arrival: int


class SampleBatcher:
    def __init__(self, sampler: Any, max_batch: int = 16, *, fair: bool = True) -> None:
        self.sampler = sampler
        self.max_batch = max_batch
        self.fair = fair  # False: arrival order
        self.share = FairShare()
        self._pending: list[_Waiting] = []
        self._in_flight = 0  # handed to the sampler, not answered yet
        self._arrivals = 0
        self._cond = threading.Condition()
        self.batches = 0
        threading.Thread(target=self._run, name="sample-batcher", daemon=True).start()

    def sample(self, request: SampleRequest, progress: Callable[[list[list[int]]], None] | None = None, *,
               tenant: str = "", weight: float = 1.0) -> SampleOutput:
        """`progress`, when given, gets each sample's tokens so far between decode steps (samplers with `serve`)."""
        done: Future[SampleOutput] = Future()
        if progress is not None:
            done.progress = progress  # type: ignore[attr-defined]  # read by the sampler's serve loop
        with self._cond:
            waiting = {item.tenant for item in self._pending}
            if tenant not in waiting:
                self.share.lift(tenant)
                self.share.forget_idle(waiting)
            self._arrivals += 1
            self._pending.append(_Waiting(request, done, tenant, weight, self._arrivals))
            self._cond.notify()
        return done.result()

    def _take(self) -> list[tuple[SampleRequest, Future[SampleOutput]]]:
        """The next requests for the sampler, as many as there is room for, the least-served tenants' first."""
        with self._cond:
            taken = [self._next() for _ in range(min(len(self._pending), self.max_batch - self._in_flight))]
            self._in_flight += len(taken)
        for item in taken:
            item.done.add_done_callback(self._answered)
        return [(item.request, item.done) for item in taken]

    def _next(self) -> _Waiting:
        item = min(self._pending, key=lambda w: self.share.order_key(w.tenant, w.arrival) if self.fair
                   else (0.0, w.arrival))
        self._pending.remove(item)
        self.share.charge(item.tenant, op_cost(Op.SAMPLE, item.request), item.weight or 1.0)
        return item

    def _answered(self, _: Future[SampleOutput]) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify()

    def _gather(self, quiet: float = 0.005, longest: float = 0.03) -> None:
        """Before a generation starts, let a burst of requests finish arriving: joining later costs each
        its own prefill and leaves it behind the others for the rest of the generation."""
        deadline = time.monotonic() + longest
        with self._cond:
            while time.monotonic() < deadline:
                seen = len(self._pending)
                self._cond.wait(quiet)
                if len(self._pending) == seen:
                    return

    def _run(self) -> None:
        serve = self.sampler.serve if isinstance(self.sampler, ContinuousSampling) else None
        while True:
            with self._cond:
                while not self._pending or self._in_flight >= self.max_batch:
                    self._cond.wait()
            if serve is None:
                batch = self._take()
            else:
                self._gather()
                try:
                    serve(self._take)  # resolves every future it took, with a result or its own error
                except Exception:  # keep serving the requests still to come
                    log.exception("the sampler's generation loop failed")
                self.batches += 1
                continue
            try:
                outputs = self.sampler.sample([req for req, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - each waiter gets the error of its batch
                if len(batch) > 1:  # one bad request must not fail the others: retry them one by one
                    for req, done in batch:
                        try:
                            done.set_result(self.sampler.sample([req])[0])
                        except BaseException as single:  # noqa: BLE001
                            done.set_exception(single)
                else:
                    batch[0][1].set_exception(exc)
                continue
            self.batches += 1
            for (_, done), out in zip(batch, outputs, strict=True):
                done.set_result(out)
