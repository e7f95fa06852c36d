"""Per-run, per-step metrics as pools record them (real Redis), and the series the console draws."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from twinkle.errors import InvalidRequest
from twinkle.futures import FutureRecord, Op
from twinkle.keys import Keys
from twinkle.ledger import SyncLedger
from twinkle.records import ModelRecord
from twinkle.run_metrics import MAX_ENTRIES, RunMetrics, parse_entry, step_series
from twinkle.types import ForwardBackwardOutput

RUN = "s1:train:0"


@pytest.fixture
def store() -> Iterator[tuple[redis.Redis, Keys]]:
    """Real Redis (db 1, shared by unit tests) under a prefix of its own, removed afterwards."""
    require_redis()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    r.hset(keys.model(RUN), mapping=ModelRecord(RUN, "t1", "s1", "tiny", "app", "q").to_hash())
    yield r, keys
    for key in r.scan_iter(match=keys.root + "*"):
        r.delete(key)
    r.close()


def record(metrics: RunMetrics, rec: FutureRecord, result: Any) -> None:
    """What a pool does with a finished op's metrics: send the call along with its other writes."""
    call = metrics.call(rec, result)
    if call is not None:
        SyncLedger(metrics.r).run(call)


def op(kind: str, model_id: str = RUN) -> FutureRecord:
    return FutureRecord(request_id=uuid.uuid4().hex, op=kind, owner="t1", model_id=model_id, queue="q")


def fb(loss: float) -> ForwardBackwardOutput:
    return ForwardBackwardOutput(loss_fn_outputs=[], metrics={"loss:sum": loss, "tokens:mean": 3.0})


def entries(r: redis.Redis, keys: Keys) -> list[dict]:
    return [parse_entry(e) for e in r.lrange(keys.run_metrics(RUN), 0, -1)]


def test_forward_backward_counts_toward_the_step_its_gradients_go_into(store: tuple[redis.Redis, Keys]) -> None:
    r, keys = store
    metrics = RunMetrics(r, keys)
    for step_loss in (4.0, 3.0):
        record(metrics, op(Op.FORWARD_BACKWARD), fb(step_loss))  # a batch in two chunks
        record(metrics, op(Op.FORWARD_BACKWARD), fb(step_loss))
        record(metrics, op(Op.OPTIM_STEP), {"metrics": {"grad_norm:mean": 1.5, "bad:mean": float("nan")}})
    record(metrics, op(Op.FORWARD), fb(1.0))
    series = step_series(entries(r, keys))
    assert series["loss:sum"] == [(1, 8.0), (2, 6.0)]  # chunks of one step add up (a sum reduction)
    assert series["tokens:mean"] == [(1, 3.0), (2, 3.0)]  # ... and means average
    assert series["grad_norm:mean"] == [(1, 1.5), (2, 1.5)]
    assert series["eval/loss:sum"] == [(3, 1.0)]
    assert "bad:mean" not in series
    assert ModelRecord.from_hash(r.hgetall(keys.model(RUN))).steps == 2


def test_a_twinkle_accumulation_call_that_did_not_step_keeps_the_step(store: tuple[redis.Redis, Keys]) -> None:
    r, keys = store
    metrics = RunMetrics(r, keys)
    record(metrics, op(Op.FORWARD_BACKWARD), {"loss": 2.0, "metrics": {"loss:sum": 20.0}, "logprobs": []})
    record(metrics, op(Op.CLIP_GRAD_AND_STEP), {"stepped": False, "cur_step": 0, "grad_norm": None, "lr": 0.1})
    record(metrics, op(Op.CLIP_GRAD_AND_STEP), {"stepped": True, "cur_step": 1, "grad_norm": 0.5, "lr": 0.1})
    assert [(e["op"], e["step"]) for e in entries(r, keys)] == [
        ("forward_backward", 1), ("clip_grad_and_step", 1), ("clip_grad_and_step", 1)]
    assert step_series(entries(r, keys))["loss"] == [(1, 2.0)]


def test_the_list_is_capped_and_gone_runs_or_other_ops_leave_nothing(store: tuple[redis.Redis, Keys]) -> None:
    r, keys = store
    metrics = RunMetrics(r, keys)
    pipe_ops = MAX_ENTRIES + 5
    for _ in range(pipe_ops):
        record(metrics, op(Op.OPTIM_STEP), {"metrics": {"grad_norm:mean": 1.0}})
    assert r.llen(keys.run_metrics(RUN)) == MAX_ENTRIES
    assert entries(r, keys)[-1]["step"] == pipe_ops
    record(metrics, op(Op.FORWARD_BACKWARD, model_id="s9:train:0"), fb(1.0))
    record(metrics, op(Op.SAMPLE), fb(1.0))
    assert not r.exists(keys.run_metrics("s9:train:0")) and not r.exists(keys.model("s9:train:0"))


def test_failures_are_kept_newest_first_and_capped(store: tuple[redis.Redis, Keys]) -> None:
    r, keys = store
    metrics = RunMetrics(r, keys)
    for i in range(105):
        metrics.record_failure(op(Op.FORWARD_BACKWARD), InvalidRequest(f"bad input {i}", hint="Fix it."))
    assert r.llen(keys.recent_errors()) == 100
    assert b"bad input 104 Fix it." in r.lindex(keys.recent_errors(), 0)


def test_metrics_sent_along_with_a_finish_count_only_where_that_finish_was_written(
        store: tuple[redis.Redis, Keys]) -> None:
    r, keys = store
    metrics = RunMetrics(r, keys)
    mine, theirs = op(Op.OPTIM_STEP), op(Op.OPTIM_STEP)
    r.hset(keys.future(mine.request_id), "finished_at", "1700000000.25")
    r.hset(keys.future(theirs.request_id), "finished_at", "1700000009.5")  # another worker's outcome

    for rec in (mine, theirs):
        call = metrics.call(rec, {"metrics": {"grad_norm:mean": 1.0}}, finished_at="1700000000.25")
        assert call is not None
        SyncLedger(r).run(call)

    assert [e["step"] for e in entries(r, keys)] == [1]
    assert ModelRecord.from_hash(r.hgetall(keys.model(RUN))).steps == 1
