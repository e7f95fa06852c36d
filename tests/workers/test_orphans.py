"""Unacked messages of our queue that our worker neither holds nor runs go back at the head of the queue."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.private_redis import PrivateRedis
from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX
from twinkle.pool_lease import PoolLease
from workers.orphans import OrphanSweep


@pytest.fixture
def r(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    broker = PrivateRedis(tmp_path_factory.mktemp("orphans"))  # kombu's keys are global: never the shared Redis
    broker.start()
    client = redis.Redis(port=broker.port)
    yield client
    client.close()
    broker.kill()


def deliver(r: redis.Redis, task_id: str, queue: str, age: float) -> None:
    tag = uuid.uuid4().hex
    message = [{"body": "e30=", "headers": {"id": task_id}, "properties": {"delivery_tag": tag}}, "", queue]
    r.hset(UNACKED, tag, json.dumps(message))
    r.zadd(UNACKED_INDEX, {tag: time.time() - age})


def test_only_old_entries_of_our_queue_that_we_do_not_hold_are_put_back_oldest_at_the_head(r: redis.Redis) -> None:
    deliver(r, "orphan-old", "model.a.0", age=30)
    deliver(r, "orphan-new", "model.a.0", age=10)
    deliver(r, "held", "model.a.0", age=30)  # prefetched or running: ours
    deliver(r, "fresh", "model.a.0", age=0.1)  # being registered right now
    deliver(r, "other-pool", "model.b.0", age=30)  # another pool's consumer owns it
    sweep = OrphanSweep(r, "model.a.0", lambda: {"held"}, min_age=5)
    assert sweep.sweep() == 2
    ids = [json.loads(raw)["headers"]["id"] for raw in r.lrange("model.a.0", 0, -1)]
    assert ids == ["orphan-new", "orphan-old"]  # BRPOP takes from the right: the oldest runs first
    left = {json.loads(raw)[0]["headers"]["id"] for raw in r.hvals(UNACKED)}
    assert left == {"held", "fresh", "other-pool"} and r.zcard(UNACKED_INDEX) == 3
    assert sweep.sweep() == 0


def test_a_worker_that_lost_its_pool_lease_puts_nothing_back(r: redis.Redis) -> None:
    keys = Keys()
    frozen = PoolLease(r, keys, "model.a.0", 30, on_lost=lambda _why: None)
    frozen.acquire()
    r.delete(keys.pool_lease("model.a.0"))  # its lease lapsed while it was frozen
    PoolLease(r, keys, "model.a.0", 30).acquire()  # and another worker took the queue
    deliver(r, "the-successors-op", "model.a.0", age=30)  # the successor runs it; the frozen worker never saw it
    assert OrphanSweep(r, "model.a.0", lambda: set(), min_age=5, lease=frozen).sweep() == 0
    assert r.llen("model.a.0") == 0 and r.hlen(UNACKED) == 1
