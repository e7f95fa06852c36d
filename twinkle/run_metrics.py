"""Each training op's metrics, kept per run and per optimizer step, for the console's loss curves.

The pool knows an op's metrics when it finishes it; it appends them to the run's list in Redis as
`<step> <json>`, where step n is the n-th optimizer step: a forward_backward belongs to the step that its
gradients go into (one more than the steps taken so far), an optim_step closes it. Ops of one run execute
one at a time on its pool, but the step counter still lives in the model record and the append is one
script, so a restarted worker counts on from where the last one stopped. Lists are capped (the newest
MAX_ENTRIES entries stay) so a run that trains for days costs a bounded amount of memory.

Recent failures of all pools are kept in one capped list too, for the operators' console.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import redis

from twinkle.errors import TwinkleError
from twinkle.futures import FutureRecord, Op
from twinkle.ledger import lifecycle
from twinkle.ledger.call import Call
from twinkle.types import ForwardBackwardOutput

log = logging.getLogger("twinkle.worker")
MAX_ENTRIES = 2000  # per run: a few days of steps at a step a minute, ~200 KB
MAX_ERRORS = 100
STEP_OPS = {Op.OPTIM_STEP, Op.CLIP_GRAD_AND_STEP}
RECORDED_OPS = {Op.FORWARD_BACKWARD, Op.FORWARD, *STEP_OPS}


def op_metrics(result: Any) -> dict[str, float]:
    """The finite numeric metrics an op reported (Tinker results or the Twinkle-native dicts)."""
    if isinstance(result, ForwardBackwardOutput):
        raw: Any = result.metrics
    elif isinstance(result, dict):
        raw = dict(result.get("metrics") or {})
        for name in ("loss", "grad_norm", "lr"):  # Twinkle-native summaries next to the backend's metrics
            if isinstance(result.get(name), (int, float)):
                raw.setdefault(name, result[name])
    else:
        return {}
    out: dict[str, float] = {}
    for name, value in raw.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[str(name)] = float(value)
    return out


class RunMetrics:
    def __init__(self, r: redis.Redis, keys: Any) -> None:
        self.r = r
        self.keys = keys

    def call(self, rec: FutureRecord, result: Any, finished_at: str = "") -> Call[int] | None:
        """The ledger call that appends a finished op's metrics to its run (None: the op reports none), for the
        pool to send along with the op's finish (`SyncLedger.run_with`). With `finished_at`, it appends only if
        the op's record says it finished then: the finish sent before it in the same round trip was written (not
        refused; an outcome another worker wrote is not this one's to count)."""
        if not rec.model_id or rec.op not in RECORDED_OPS:
            return None
        steps = rec.op in STEP_OPS and not (isinstance(result, dict) and result.get("stepped") is False)
        metrics = op_metrics(result)
        if not metrics and not steps:
            return None
        entry = json.dumps({"op": rec.op, "t": round(time.time(), 3), "metrics": metrics}, separators=(",", ":"))
        return lifecycle.append_run_metrics(self.keys, rec.request_id, rec.model_id, steps=steps, entry=entry,
                                            max_entries=MAX_ENTRIES, finished_at=finished_at)

    def record_failure(self, rec: FutureRecord, exc: TwinkleError) -> None:
        entry = json.dumps({"t": round(time.time(), 3), "op": rec.op, "queue": rec.queue, "owner": rec.owner,
                            "model_id": rec.model_id, "request_id": rec.request_id, "category": exc.category,
                            "code": exc.code, "error": str(exc)[:500]}, separators=(",", ":"))
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.lpush(self.keys.recent_errors(), entry)
            pipe.ltrim(self.keys.recent_errors(), 0, MAX_ERRORS - 1)
            pipe.execute()
        except redis.RedisError as exc2:
            log.warning("failure of %s not recorded: %s", rec.request_id, exc2)


def parse_entry(raw: bytes | str) -> dict[str, Any]:
    """`<step> <json>` as written by RunMetrics, back into {step, op, t, metrics}."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    step, _, body = text.partition(" ")
    entry: dict[str, Any] = json.loads(body)
    entry["step"] = int(step)
    return entry


def step_series(entries: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per metric, one (step, value) point per optimizer step, ascending.

    Several ops of one step (a batch sent in chunks, forward and backward separately) combine by the
    reduction the metric's name carries: `loss:sum` adds up, `x:max` / `x:min` keep the extreme, anything
    else (`:mean`, plain names) averages. Metrics of forward-only ops (evaluation) are kept apart as `eval/...`.
    """
    grouped: dict[str, dict[int, list[float]]] = {}
    for entry in entries:
        prefix = "eval/" if entry.get("op") == Op.FORWARD else ""
        for name, value in (entry.get("metrics") or {}).items():
            grouped.setdefault(prefix + name, {}).setdefault(int(entry["step"]), []).append(float(value))
    out: dict[str, list[tuple[int, float]]] = {}
    for name, by_step in grouped.items():
        reduction = name.rpartition(":")[2] if ":" in name else "mean"
        out[name] = [(step, _combine(reduction, values)) for step, values in sorted(by_step.items())]
    return dict(sorted(out.items()))


def _combine(reduction: str, values: list[float]) -> float:
    if reduction == "sum":
        return float(sum(values))
    if reduction in ("max", "min"):
        return float(max(values) if reduction == "max" else min(values))
    return float(sum(values) / len(values))

