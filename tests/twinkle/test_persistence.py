from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import redis

from twinkle.futures import FutureRecord
from twinkle.keys import Keys
from twinkle.records import ModelRecord
from twinkle.state.persistence import clear_persistence, restore_snapshot, save_snapshot
from twinkle.usage import UsageLedger

URL = "redis://127.0.0.1:6379/13"


def config(tmp_path: Path, mode: str = "file") -> SimpleNamespace:
    return SimpleNamespace(
        persistence=SimpleNamespace(mode=mode, file_path=str(tmp_path / "state.json"), redis_url=None,
                                    key_prefix="pfx:"),
        broker=SimpleNamespace(url=URL))


def test_a_file_snapshot_restores_training_runs_into_an_empty_broker(tmp_path: Path) -> None:
    r = redis.Redis.from_url(URL)
    r.flushdb()
    keys = Keys("pfx:")
    run = ModelRecord("s1:train:0", "tenant", "s1", "tiny", "models", "model.models.0", lora={"rank": 4})
    r.hset(keys.model(run.model_id), mapping=run.to_hash())
    r.sadd(keys.owner_runs("tenant"), run.model_id)
    r.hset(keys.future("transient"), "status", "queued")
    assert save_snapshot(r, keys, tmp_path / "state.json") == 2
    r.flushdb()
    assert restore_snapshot(r, tmp_path / "state.json") == 2
    assert ModelRecord.from_hash(r.hgetall(keys.model(run.model_id))) == run
    assert not r.exists(keys.future("transient"))


def test_clear_persistence_removes_exactly_twinkles_keys(tmp_path: Path) -> None:
    r = redis.Redis.from_url(URL)
    r.flushdb()
    keys = Keys("pfx:")
    r.set(keys.future("a"), "1")
    r.set(keys.blob_in("a"), "1")
    r.set("someone-else", "1")
    (tmp_path / "state.json").write_text('{"x": {}}')
    assert clear_persistence(config(tmp_path)) == 3
    assert r.keys() == [b"someone-else"]
    assert not (tmp_path / "state.json").exists()
    r.flushdb()


def test_the_usage_ledger_survives_a_broker_restart_through_the_file_snapshot(tmp_path: Path) -> None:
    r = redis.Redis.from_url(URL)
    r.flushdb()
    keys = Keys("pfx:")
    rec = FutureRecord("r1", "forward_backward", "tenant", "s1:train:0", "model.models.0")
    r.hset(keys.future(rec.request_id), mapping=rec.to_hash())
    assert UsageLedger(r, keys).record(rec, "tiny", {"trained_tokens": 123, "pool_ms": 7})
    save_snapshot(r, keys, tmp_path / "state.json")
    r.flushdb()
    restore_snapshot(r, tmp_path / "state.json")
    assert UsageLedger(r, keys).totals("tenant", "total") == {"trained_tokens": 123, "pool_ms": 7}
    assert UsageLedger(r, keys).totals("tenant", "day") == {"trained_tokens": 123, "pool_ms": 7}
