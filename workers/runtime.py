"""The bookkeeping around every op a pool runs: future states, duplicates, lost state, results.

One runtime per pool process. Celery tasks are thin: they call `PoolRuntime.execute(op, request_id)`,
which never raises, so every message is acked exactly when its future reached a terminal state.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import redis

from twinkle import blobs
from twinkle.errors import AdapterGone, BackendFailure, TwinkleError, lost_state_error
from twinkle.futures import FutureRecord, FutureStatus, Op
from twinkle.keys import Keys
from twinkle.records import ModelRecord

log = logging.getLogger("twinkle.worker")

Handler = Callable[[FutureRecord, Any], Any]


class PoolRuntime:
    def __init__(self, r: redis.Redis, keys: Keys, queue: str, handlers: dict[str, Handler], *,
                 future_ttl: int, has_adapter: Callable[[str], bool] | None = None) -> None:
        self.r = r
        self.keys = keys
        self.queue = queue
        self.handlers = handlers
        self.future_ttl = future_ttl
        self.has_adapter = has_adapter
        self.ops_done = 0
        self.lock = threading.Lock()  # ops and the adapter reaper never touch the backend at once

    def execute(self, op: str, request_id: str) -> None:
        raw = self.r.hgetall(self.keys.future(request_id))
        if not raw:
            log.warning("future %s is gone (expired?); dropping %s", request_id, op)
            return
        rec = FutureRecord.from_hash(raw)
        if rec.state.terminal:
            log.info("duplicate delivery of %s %s ignored", op, request_id)
            return
        self._mark_started(rec)
        if rec.state is FutureStatus.RUNNING:
            # It was running when its worker died: whatever it did to the adapter is lost.
            self._fail(rec, self._lost(rec.model_id))
            return
        started = time.perf_counter()
        try:
            self._check_adapter_alive(op, rec)
            payload = self._load_input(request_id)
            self._mark_running(rec)
            with self.lock:
                result = self.handlers[op](rec, payload)
        except TwinkleError as exc:
            self._fail(rec, exc)
        except Exception as exc:  # noqa: BLE001 - any backend bug becomes a failed future, never a hang
            log.error("%s %s failed:\n%s", op, request_id, traceback.format_exc())
            self._fail(rec, BackendFailure(
                f"{op} failed inside the server ({type(exc).__name__}).",
                hint=f"This is a server problem; report request id {request_id} to the operator.",
            ))
        else:
            self._complete(rec, result)
        finally:
            self.ops_done += 1
            log.debug("%s %s took %.1f ms", op, request_id, (time.perf_counter() - started) * 1000)

    # -- steps ---------------------------------------------------------------------------------

    def _mark_started(self, rec: FutureRecord) -> None:
        started_key = self.keys.queue_started(rec.queue or self.queue)
        current = self.r.get(started_key)
        if current is None or int(current) < rec.ticket:
            self.r.set(started_key, rec.ticket)

    def _mark_running(self, rec: FutureRecord) -> None:
        pipe = self.r.pipeline(transaction=True)
        if rec.model_id:
            pipe.hincrby(self.keys.model(rec.model_id), "ops_executed", 1)
        pipe.hset(self.keys.future(rec.request_id), mapping={"status": FutureStatus.RUNNING,
                                                             "started_at": time.time()})
        results = pipe.execute()
        if rec.model_id:
            self.r.hset(self.keys.future(rec.request_id), "exec_index", int(results[0]))

    def _check_adapter_alive(self, op: str, rec: FutureRecord) -> None:
        if self.has_adapter is None or op in (Op.CREATE_MODEL, Op.SAMPLE, Op.UNLOAD_MODEL) or not rec.model_id:
            return
        model = self._model(rec.model_id)
        if model is not None and model.status != "active":
            raise AdapterGone(f"Model {rec.model_id} was unloaded: {model.unload_reason or 'unloaded'}.",
                              hint="Create a new model" + (f" and load {model.last_checkpoint}."
                                                           if model.last_checkpoint else "."))
        if op != Op.LOAD_STATE and not self.has_adapter(rec.model_id):
            raise self._lost(rec.model_id)

    def _model(self, model_id: str) -> ModelRecord | None:
        raw = self.r.hgetall(self.keys.model(model_id))
        return ModelRecord.from_hash(raw) if raw else None

    def _lost(self, model_id: str) -> TwinkleError:
        model = self._model(model_id)
        return lost_state_error(model_id, (model.last_checkpoint if model else "") or None)

    def _load_input(self, request_id: str) -> Any:
        data = self.r.get(self.keys.blob_in(request_id))
        return blobs.loads(data) if data else None

    def _complete(self, rec: FutureRecord, result: Any) -> None:
        rid = rec.request_id
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.keys.blob_out(rid), blobs.dumps(result), ex=self.future_ttl)
        pipe.hset(self.keys.future(rid), mapping={"status": FutureStatus.COMPLETED, "finished_at": time.time()})
        pipe.expire(self.keys.future(rid), self.future_ttl)
        pipe.delete(self.keys.blob_in(rid))
        pipe.publish(self.keys.done_channel(rid), FutureStatus.COMPLETED.value)
        pipe.execute()

    def _fail(self, rec: FutureRecord, exc: TwinkleError) -> None:
        rid = rec.request_id
        log.info("%s %s failed: %s", rec.op, rid, exc)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.future(rid), mapping={
            "status": FutureStatus.FAILED, "finished_at": time.time(), "error": str(exc),
            "category": exc.category, "code": exc.code,
        })
        pipe.expire(self.keys.future(rid), self.future_ttl)
        pipe.delete(self.keys.blob_in(rid))
        pipe.publish(self.keys.done_channel(rid), FutureStatus.FAILED.value)
        pipe.execute()
