"""Periodic adapter snapshots (`adapter_config.snapshot_interval`), so a crash loses minutes, not a run.

Every `interval` seconds each adapter the pool holds that ran an op since its last snapshot is saved, with
its optimizer state, as the training checkpoint `<checkpoint_dir>/<tenant>/<run>/weights/auto-snapshot-<ms>`
through the same path as a client's `save_state`. That makes it the model's `last_checkpoint`, which is
what AdapterStateLost names after a crash. Only the newest `keep` automatic snapshots of a run are kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from twinkle.checkpoints import CheckpointRef
from twinkle.futures import FutureRecord, Op
from twinkle.records import ModelRecord
from twinkle.types import SaveRequest
from workers.handlers import ModelPoolHandlers

log = logging.getLogger("twinkle.snapshots")
PREFIX = "auto-snapshot-"


class AdapterSnapshots:
    def __init__(self, handlers: ModelPoolHandlers, lock: Any, interval: float, *, keep: int = 2,
                 clock: Callable[[], float] = time.time) -> None:
        self.handlers = handlers
        self.lock = lock
        self.interval = interval
        self.keep = keep
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # adapter -> (time, ops_executed) at its last snapshot

    def start(self) -> None:
        threading.Thread(target=self.run_forever, name="adapter-snapshots", daemon=True).start()

    def run_forever(self) -> None:
        while True:
            time.sleep(min(self.interval, 5.0))
            try:
                self.take_due()
            except redis.RedisError as exc:
                log.warning("adapter snapshots skipped: %s", exc)
            except Exception:
                log.exception("adapter snapshots failed")

    def take_due(self) -> list[str]:
        """Snapshot every adapter that is due; returns the checkpoint paths written."""
        now = self.clock()
        live = set(self.handlers.adapter_ids())
        for gone in set(self._last) - live:
            del self._last[gone]
        written = []
        for adapter_id in sorted(live):
            model = self._model(adapter_id)
            if model is None or model.status != "active":
                continue
            # first sight: nothing of it is saved yet, and its interval runs from its creation, so an adapter
            # that trained before this thread first looked is still saved
            last_time, last_ops = self._last.setdefault(adapter_id, (model.created_at or now, 0))
            if now - last_time < self.interval or model.ops_executed == last_ops:
                continue
            with self.lock:
                if adapter_id not in self.handlers.adapter_ids():
                    continue  # unloaded meanwhile
                written.append(self.snapshot(model))
            self._last[adapter_id] = (now, model.ops_executed)
        return written

    def snapshot(self, model: ModelRecord) -> str:
        name = f"{PREFIX}{int(self.clock() * 1000)}"
        rec = FutureRecord(request_id=f"{PREFIX}{model.model_id}", op=Op.SAVE_STATE, owner=model.owner,
                           model_id=model.model_id, queue=self.handlers.queue)
        result = self.handlers.save(rec, SaveRequest(name=name, kind="weights", include_optimizer=True,
                                                     user_metadata={"automatic": "true"}))
        self.prune(model)
        log.info("snapshot of %s: %s", model.model_id, result["path"])
        return str(result["path"])

    def prune(self, model: ModelRecord) -> None:
        """Delete all but the newest `keep` automatic snapshots of the model's run."""
        store = self.handlers.store
        weights = store.tenant_dir(model.owner) / model.model_id / "weights"
        names = sorted((p.name for p in weights.glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit()),
                       key=lambda name: int(name[len(PREFIX):]))
        for name in names[: max(0, len(names) - self.keep)]:
            ref = CheckpointRef(model.model_id, "weights", name)
            store.delete(model.owner, ref)
            self.handlers.r.hdel(self.handlers.keys.checkpoints(model.model_id), ref.checkpoint_id)

    def _model(self, adapter_id: str) -> ModelRecord | None:
        raw = self.handlers.r.hgetall(self.handlers.keys.model(adapter_id))
        return ModelRecord.from_hash(raw) if raw else None
