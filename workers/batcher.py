"""Continuous batching for a sampler pool.

The sampler pool consumes several sample tasks at once (Celery threads, one per slot); each task
thread hands its request to the batcher and waits. One generation thread takes everything waiting
(up to `max_batch` requests) and serves it with a single `sampler.sample(batch)` call, so requests
for different adapters share one batched generation.
"""

from __future__ import annotations

import logging
import threading
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

    def sample(self, request: SampleRequest) -> SampleOutput:
        done: Future[SampleOutput] = Future()
        with self._cond:
            self._pending.append((request, done))
            self._cond.notify()
        return done.result()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
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
