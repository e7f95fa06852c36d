"""The adapter reaper frees the adapters that went idle, outlived their lifetime, were released or lost their record."""

from __future__ import annotations

import threading
import time

import redis

from twinkle.keys import Keys
from twinkle.records import ModelRecord
from workers.lifecycle import AdapterReaper


def adapter(r: redis.Redis, keys: Keys, model_id: str, *, session: str, age: float, idle: float,
            status: str = "active") -> None:
    now = time.time()
    record = ModelRecord(model_id=model_id, owner="t-owner", session_id=session, base_model="tiny", app="models",
                         queue="model.a.0", created_at=now - age, last_request_at=now - idle, status=status,
                         unload_reason="session finished" if status != "active" else "")
    r.hset(keys.model(model_id), mapping=record.to_hash())
    r.sadd(keys.owner_models("t-owner"), model_id)
    r.sadd(keys.pool_assigned("model.a.0"), model_id)


def reaper(r: redis.Redis, keys: Keys, resident: list[str], removed: list[str], **limits: float) -> AdapterReaper:
    def remove(adapter_id: str) -> None:
        removed.append(adapter_id)
        resident.remove(adapter_id)

    return AdapterReaper(r, keys, adapter_ids=lambda: list(resident), remove=remove, lock=threading.Lock(),
                         adapter_timeout=limits.get("adapter_timeout", 60.0),
                         max_lifetime=limits.get("max_lifetime", 0.0))


def test_a_sweep_frees_idle_released_and_lost_adapters_and_keeps_the_rest(redis_keys: tuple[redis.Redis, Keys]
                                                                         ) -> None:
    r, keys = redis_keys
    adapter(r, keys, "busy", session="s-busy", age=600, idle=5)
    adapter(r, keys, "heartbeating", session="s-beat", age=600, idle=600)
    r.hset(keys.session("s-beat"), "last_heartbeat", time.time() - 5)
    adapter(r, keys, "idle", session="s-idle", age=600, idle=600)
    r.hset(keys.session("s-idle"), "last_heartbeat", time.time() - 300)
    adapter(r, keys, "released", session="s-busy", age=10, idle=1, status="unloaded")
    resident = ["busy", "heartbeating", "idle", "released", "lost"]  # "lost" has no record in the broker
    removed: list[str] = []

    expired = reaper(r, keys, resident, removed).sweep()

    assert sorted(expired) == sorted(removed) == ["idle", "lost", "released"]
    assert resident == ["busy", "heartbeating"]
    idle = ModelRecord.from_hash(r.hgetall(keys.model("idle")))
    assert idle.status == "unloaded" and "no heartbeat or request for 60 s" in idle.unload_reason
    assert not r.sismember(keys.owner_models("t-owner"), "idle")
    assert not r.sismember(keys.pool_assigned("model.a.0"), "idle")
    assert r.sismember(keys.owner_models("t-owner"), "busy")


def test_an_adapter_past_its_lifetime_is_freed_however_recently_it_was_used(redis_keys: tuple[redis.Redis, Keys]
                                                                           ) -> None:
    r, keys = redis_keys
    adapter(r, keys, "old", session="s", age=7200, idle=1)
    adapter(r, keys, "young", session="s", age=60, idle=1)
    resident, removed = ["old", "young"], []

    assert reaper(r, keys, resident, removed, adapter_timeout=0, max_lifetime=3600).sweep() == ["old"]
    assert "maximum adapter lifetime" in ModelRecord.from_hash(r.hgetall(keys.model("old"))).unload_reason


def test_a_sweep_reads_the_broker_in_two_round_trips_however_many_adapters_it_holds(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    resident = [f"a{i}" for i in range(40)]
    for i, model_id in enumerate(resident):
        adapter(r, keys, model_id, session=f"s{i}", age=600, idle=1)
    sent: list[object] = []
    original = redis.connection.Connection.send_packed_command

    def counted(connection: redis.connection.Connection, command: object, check_health: bool = True) -> None:
        sent.append(command)
        original(connection, command, check_health)

    redis.connection.Connection.send_packed_command = counted  # type: ignore[method-assign]
    try:
        assert reaper(r, keys, resident, []).sweep() == []
    finally:
        redis.connection.Connection.send_packed_command = original  # type: ignore[method-assign]
    assert len(sent) == 2
