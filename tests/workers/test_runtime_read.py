"""A pool reads an op's record, payload and model in one round trip when the op's message names its model; the
record stays the authority on which model that is."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.records import ModelRecord
from workers.runtime import PoolRuntime

QUEUE = "model.pool.0"


def model(r: redis.Redis, keys: Keys, model_id: str, status: str) -> None:
    r.hset(keys.model(model_id), mapping=ModelRecord(model_id=model_id, owner="t", session_id="s", base_model="b",
                                                      app="pool", queue=QUEUE, status=status).to_hash())


@pytest.mark.parametrize("named", ["m", "", "unloaded-one"])
def test_an_op_runs_with_the_model_its_record_names_whatever_its_message_names(
        redis_keys: tuple[redis.Redis, Keys], named: str) -> None:
    r, keys = redis_keys
    model(r, keys, "m", "active")
    model(r, keys, "unloaded-one", "unloaded")  # read as the op's model, it would fail the op (adapter gone)
    ran: list[str] = []

    def forward(rec: FutureRecord, _payload: Any) -> dict[str, Any]:
        ran.append(rec.model_id)
        return {"ok": True}

    runtime = PoolRuntime(r, keys, QUEUE, {"forward": forward}, future_ttl=60, has_adapter=lambda _: True)
    r.hset(keys.future("op"), mapping=FutureRecord(request_id="op", op="forward", owner="t", model_id="m",
                                                    queue=QUEUE, created_at=time.time()).to_hash())
    runtime.execute("forward", "op", named)
    assert ran == ["m"]
    assert FutureRecord.from_hash(r.hgetall(keys.future("op"))).state is FutureStatus.COMPLETED
