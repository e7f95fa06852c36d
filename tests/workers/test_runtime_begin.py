"""Beginning an op is one script; redis-py sends it again when the broker died before its reply reached the
worker, and the op must still count once on its model (a flapping broker otherwise skewed `ops_executed`)."""

from __future__ import annotations

import time

import redis

from twinkle.futures import FutureRecord
from twinkle.keys import Keys
from twinkle.records import ModelRecord
from workers.runtime import PoolRuntime

QUEUE = "model.pool.0"


def test_the_same_begin_sent_twice_counts_the_op_once_and_a_new_attempt_counts_again(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    runtime = PoolRuntime(r, keys, QUEUE, {}, future_ttl=60)
    r.hset(keys.model("m"), mapping=ModelRecord(model_id="m", owner="t", session_id="s", base_model="b", app="pool",
                                                 queue=QUEUE).to_hash())
    r.hset(keys.future("op"), mapping=FutureRecord(request_id="op", op="forward", owner="t", model_id="m",
                                                    queue=QUEUE, created_at=time.time()).to_hash())
    begin = [keys.future("op"), keys.model("m"), keys.queue_started(QUEUE), ""]

    first = runtime._begin_script(keys=begin, args=[time.time(), 1, "", "attempt-1"])
    again = runtime._begin_script(keys=begin, args=[time.time(), 1, "", "attempt-1"])

    assert first == again == 1
    assert int(r.hget(keys.model("m"), "ops_executed") or 0) == 1
    assert runtime._begin_script(keys=begin, args=[time.time(), 1, "", "attempt-2"]) == 2  # a real second run


def test_an_op_a_sweep_failed_while_the_pool_held_it_is_never_begun(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    runtime = PoolRuntime(r, keys, QUEUE, {}, future_ttl=60)
    r.hset(keys.future("op"), mapping=FutureRecord(request_id="op", op="forward", owner="t", model_id="",
                                                    queue=QUEUE, created_at=time.time()).to_hash())
    r.hset(keys.future("op"), mapping={"status": "failed", "code": "queue_timeout"})
    begin = [keys.future("op"), "", keys.queue_started(QUEUE), ""]
    assert runtime._begin_script(keys=begin, args=[time.time(), 1, "", "attempt-1"]) == -3
    assert r.hget(keys.future("op"), "status") == b"failed"
