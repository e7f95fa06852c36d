"""Continuous batching for a sampler pool.

The sampler pool consumes several sample tasks at once (Celery threads, one per slot); each task
thread hands its request to the batcher and waits. One generation thread serves them:
- a sampler with `serve(take)` (the torch sampler) runs one continuous generation that calls `take`
  between decode steps, so a request arriving mid-generation joins it instead of waiting for it to end
  (a generation starts once a burst of arrivals has paused for a few ms, at most 30 ms);
- any other takes everything waiting (up to `max_batch` requests) into one `sampler.sample(batch)` call.
Either way requests for different adapters share one batched generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from twinkle.types import SampleOutput, SampleRequest

log = logging.getLogger("twinkle.batcher")


class SampleBatcher:
    def __init__(self, sampler: Any, max_batch: int = 16) -> None:
        self.sampler = sampler
        self.max_batch = max_batch
        self._pending: list[tuple[SampleRequest, Future[SampleOutput]]] = []
        self._cond = threading.Condition()
        self.batches = 0
        threading.Thread(target=self._run, name="sample-batcher", daemon=True).start()

    def sample(self, request: SampleRequest, progress: Callable[[list[list[int]]], None] | None = None
               ) -> SampleOutput:
        """`progress`, when given, gets each sample's tokens so far between decode steps (samplers with `serve`)."""
        done: Future[SampleOutput] = Future()
        if progress is not None:
            done.progress = progress  # type: ignore[attr-defined]  # read by the sampler's serve loop
        with self._cond:
            self._pending.append((request, done))
            self._cond.notify()
        return done.result()

    def _take(self) -> list[tuple[SampleRequest, Future[SampleOutput]]]:
        with self._cond:
            taken, self._pending = self._pending, []
        return taken

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
        serve = getattr(self.sampler, "serve", None)
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                if serve is None:
                    batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            if serve is not None:
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
