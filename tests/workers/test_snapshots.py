"""Periodic adapter snapshots: taken when due and only after training, named as the last checkpoint, pruned."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from twinkle.backends.mock import MockBackend
from twinkle.checkpoints import CheckpointStore
from twinkle.futures import FutureRecord, Op
from twinkle.keys import Keys
from twinkle.records import ModelRecord
from twinkle.types import LoraSpec
from workers.handlers import ModelPoolHandlers
from workers.snapshots import AdapterSnapshots

MODEL = "s1:train:0"
OWNER = "tenant1"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[ModelPoolHandlers, redis.Redis, Keys]]:
    require_redis()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    handlers = ModelPoolHandlers(MockBackend(64), None, CheckpointStore(tmp_path), r, keys, "model.pool.0")
    record = ModelRecord(model_id=MODEL, owner=OWNER, session_id="s1", base_model="tiny", app="pool",
                         queue="model.pool.0")
    r.hset(keys.model(MODEL), mapping=record.to_hash())
    handlers.create_model(FutureRecord(request_id="r0", op=Op.CREATE_MODEL, owner=OWNER, model_id=MODEL,
                                       queue="model.pool.0"), LoraSpec(rank=2))
    yield handlers, r, keys
    for key in r.scan_iter(match=f"{keys.prefix}*"):
        r.delete(key)
    r.close()


def test_an_adapter_is_snapshotted_each_interval_it_trained_and_old_snapshots_are_pruned(
        pool: tuple[ModelPoolHandlers, redis.Redis, Keys], tmp_path: Path) -> None:
    handlers, r, keys = pool
    clock = Clock()
    snapshots = AdapterSnapshots(handlers, handlers_lock(), interval=10, keep=2, clock=clock)
    assert snapshots.take_due() == []  # first sight: the interval starts now
    clock.now += 11
    assert snapshots.take_due() == []  # due, but it ran no op since
    r.hincrby(keys.model(MODEL), "ops_executed", 1)
    written = snapshots.take_due()  # trained and overdue
    for _ in range(2):
        r.hincrby(keys.model(MODEL), "ops_executed", 1)
        clock.now += 5
        assert snapshots.take_due() == []  # trained, but the last snapshot is recent
        clock.now += 6
        written.extend(snapshots.take_due())
    assert len(written) == 3
    assert ModelRecord.from_hash(r.hgetall(keys.model(MODEL))).last_checkpoint == written[-1]
    assert all(f"tinker://{MODEL}/weights/auto-snapshot-" in path for path in written)
    weights = tmp_path / OWNER / MODEL / "weights"
    assert sorted(p.name for p in weights.iterdir()) == sorted(path.rsplit("/", 1)[1] for path in written[1:])
    assert sorted(k.decode() for k in r.hkeys(keys.checkpoints(MODEL))) == sorted(
        "weights/" + path.rsplit("/", 1)[1] for path in written[1:])
    assert (weights / written[-1].rsplit("/", 1)[1] / "adapter.npz").is_file()


def test_an_adapter_that_trained_before_it_was_first_seen_is_snapshotted_once_its_interval_passed(
        pool: tuple[ModelPoolHandlers, redis.Redis, Keys]) -> None:
    handlers, r, keys = pool
    clock = Clock()
    r.hset(keys.model(MODEL), mapping={"created_at": clock.now, "ops_executed": 8})
    snapshots = AdapterSnapshots(handlers, handlers_lock(), interval=10, clock=clock)
    clock.now += 3
    assert snapshots.take_due() == []  # created 3 s ago: not due yet
    clock.now += 8
    assert len(snapshots.take_due()) == 1  # its ops ran before the first look, and they are saved
    clock.now += 11
    assert snapshots.take_due() == []  # nothing ran since


def test_an_unloaded_adapter_is_not_snapshotted(pool: tuple[ModelPoolHandlers, redis.Redis, Keys]) -> None:
    handlers, r, keys = pool
    clock = Clock()
    snapshots = AdapterSnapshots(handlers, handlers_lock(), interval=1, clock=clock)
    snapshots.take_due()
    r.hset(keys.model(MODEL), mapping={"status": "unloaded", "ops_executed": 5})
    clock.now += 2
    assert snapshots.take_due() == []


def handlers_lock() -> object:
    import threading

    return threading.Lock()
