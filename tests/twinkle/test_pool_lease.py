"""A pool queue's lease against a real Redis: one holder at a time, renewed, expiring, taken over, released,
claimed again after a broker restart lost it, and lost for good only to another worker's token."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.private_redis import PrivateRedis
from twinkle.errors import PoolLeaseHeld
from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX
from twinkle.pool_lease import PoolLease, restore_if_vacant

QUEUE = "model.pool.0"


class Lost(list[str]):
    """What a lease's `on_lost` was told (a worker exits there; a test keeps running to look)."""

    def __call__(self, why: str) -> None:
        self.append(why)


def lease(r: redis.Redis, keys: Keys, seconds: float = 5.0, **kw: object) -> tuple[PoolLease, Lost]:
    lost = Lost()
    return PoolLease(r, keys, QUEUE, seconds, on_lost=lost, **kw), lost  # type: ignore[arg-type]


def test_a_worker_takes_a_vacant_lease_that_names_it_and_expires(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    first, _ = lease(r, keys, seconds=5)
    first.acquire()
    holder = first.holder()
    assert holder is not None and holder.token == first.token and holder.host == socket.gethostname()
    assert holder.pid > 0 and abs(holder.since - time.time()) < 5 and 4 < holder.expires_in <= 5
    assert r.get(keys.pool_lease_fence(QUEUE)) == first.token.encode()


def test_a_second_worker_for_the_same_pool_is_refused_with_one_line_naming_the_holder(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    first, _ = lease(r, keys, seconds=15)
    first.acquire()
    second, _ = lease(r, keys, seconds=15)
    with pytest.raises(PoolLeaseHeld) as refused:
        second.acquire()
    line = str(refused.value)
    assert "\n" not in line and QUEUE in line and socket.gethostname() in line
    assert "pid" in line and " since 20" in line and "expires in 1" in line and "stop that worker" in line
    holder = first.holder()
    assert holder is not None and holder.token == first.token  # the refused worker changed nothing
    assert r.get(keys.pool_lease_fence(QUEUE)) == first.token.encode()


def test_renewing_keeps_the_lease_alive_past_its_time(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    holder, lost = lease(r, keys, seconds=1)
    holder.acquire()
    for _ in range(4):
        time.sleep(0.4)
        assert holder.renew() == "renewed"
    assert r.pttl(keys.pool_lease(QUEUE)) > 800 and lost == []


def test_an_expired_lease_is_taken_over_and_its_old_holder_finds_itself_fenced_off(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    frozen, lost = lease(r, keys, seconds=1)
    frozen.acquire()
    time.sleep(1.2)  # it did not renew (frozen): the lease lapsed
    successor, _ = lease(r, keys, seconds=1)
    successor.acquire()
    assert frozen.renew() == "lost" and len(lost) == 1 and "another worker took over" in lost[0]
    holder = successor.holder()
    assert holder is not None and holder.token == successor.token  # the old holder's renewal wrote nothing


def test_a_holder_replaced_while_frozen_stays_fenced_off_even_after_its_successor_stopped(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    frozen, lost = lease(r, keys, seconds=1)
    frozen.acquire()
    time.sleep(1.2)
    successor, _ = lease(r, keys, seconds=1)
    successor.acquire()
    assert successor.release()
    assert frozen.renew() == "lost" and lost
    assert not r.exists(keys.pool_lease(QUEUE))  # it claimed nothing back


def test_a_lease_missing_from_the_broker_is_claimed_again_by_its_holder_with_the_same_token(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    holder, lost = lease(r, keys, seconds=5)
    holder.acquire()
    r.delete(keys.pool_lease(QUEUE), keys.pool_lease_fence(QUEUE))  # a broker restarted without persistence
    assert holder.renew() == "reclaimed"
    r.delete(keys.pool_lease(QUEUE))  # it lapsed while the holder was cut off, and nobody took over
    assert holder.renew() == "reclaimed"
    again = holder.holder()
    assert again is not None and again.token == holder.token and again.expires_in > 4 and lost == []
    assert r.get(keys.pool_lease_fence(QUEUE)) == holder.token.encode()


def test_a_clean_stop_releases_only_its_own_lease_and_a_new_worker_takes_it_at_once(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    first, _ = lease(r, keys, seconds=15)
    first.acquire()
    stranger, _ = lease(r, keys, seconds=15)
    assert not stranger.release()
    assert first.holder() is not None
    assert first.release()
    assert first.holder() is None
    restarted, _ = lease(r, keys, seconds=15)
    restarted.acquire()
    assert restarted.holder() is not None


def _acquire_in_a_process_that_dies(r: redis.Redis, keys: Keys, host: str = "") -> int:
    """A real worker process that takes the lease and is killed (SIGKILL: no release); its pid."""
    port, db = r.connection_pool.connection_kwargs["port"], r.connection_pool.connection_kwargs["db"]
    code = (
        "import os, signal, redis\n"
        "from twinkle.keys import Keys\n"
        "from twinkle.pool_lease import PoolLease\n"
        f"lease = PoolLease(redis.Redis(port={port}, db={db}), Keys({keys.prefix!r}), {QUEUE!r}, 30,"
        f" host={host!r} or None)\n"
        "lease.acquire()\n"
        "print(os.getpid(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    return int(done.stdout.split()[0])


def test_the_lease_of_a_killed_worker_on_this_host_is_taken_at_once(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    dead = _acquire_in_a_process_that_dies(r, keys)
    holder = PoolLease(r, keys, QUEUE, 30).holder()
    assert holder is not None and holder.pid == dead and holder.expires_in > 20  # far from expired
    restarted, _ = lease(r, keys, seconds=30)
    restarted.acquire()
    assert restarted.holder().token == restarted.token  # type: ignore[union-attr]


def test_the_lease_of_a_worker_on_another_host_waits_for_its_expiry(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    _acquire_in_a_process_that_dies(r, keys, host="gpu-node-b")  # its pid means nothing here
    newcomer, _ = lease(r, keys, seconds=30)
    with pytest.raises(PoolLeaseHeld, match="on host gpu-node-b"):
        newcomer.acquire()


@pytest.fixture
def private(tmp_path: Path) -> Iterator[PrivateRedis]:
    broker = PrivateRedis(tmp_path / "redis")  # restarted below, and kombu's unacked keys are global
    broker.start()
    yield broker
    broker.kill()


def test_renewals_ride_out_a_broker_restart_and_claim_the_lost_lease_again(private: PrivateRedis) -> None:
    r = redis.Redis(port=private.port, socket_timeout=0.5, socket_connect_timeout=0.5)
    keys = Keys()
    holder, lost = lease(r, keys, seconds=1)
    holder.acquire()
    holder.start_renewing()
    private.outage(2)  # longer than the lease, and the restarted broker holds nothing
    deadline = time.time() + 5
    while not r.exists(keys.pool_lease(QUEUE)):
        assert time.time() < deadline, "the holder never claimed its lease again"
        time.sleep(0.05)
    again = holder.holder()
    assert again is not None and again.token == holder.token and lost == []
    assert holder.fresh()
    holder.release()


def _unacked(r: redis.Redis, task_id: str, queue: str) -> None:
    tag = f"tag-{task_id}"
    r.hset(UNACKED, tag, json.dumps([{"body": "e30=", "headers": {"id": task_id}}, "", queue]))
    r.zadd(UNACKED_INDEX, {tag: time.time() - 60})


def test_the_launcher_restores_a_queue_only_when_no_live_worker_holds_it(private: PrivateRedis) -> None:
    r = redis.Redis(port=private.port)
    keys = Keys()
    _unacked(r, "held-by-a-live-worker", QUEUE)
    live, _ = lease(r, keys, seconds=30)
    live.acquire()
    assert restore_if_vacant(r, keys, QUEUE) == 0  # the live worker's running and prefetched ops stay its own
    assert r.llen(QUEUE) == 0 and r.hlen(UNACKED) == 1
    live.release()
    assert restore_if_vacant(r, keys, QUEUE) == 1 and r.llen(QUEUE) == 1 and r.hlen(UNACKED) == 0


def test_a_new_holder_puts_the_previous_workers_unacked_messages_back(private: PrivateRedis) -> None:
    r = redis.Redis(port=private.port)
    keys = Keys()
    _unacked(r, "running-when-it-died", QUEUE)
    _unacked(r, "another-pool", "model.other.0")
    successor, _ = lease(r, keys, seconds=30)
    successor.acquire()
    assert successor.take_over_queue() == 1
    assert [json.loads(raw)["headers"]["id"] for raw in r.lrange(QUEUE, 0, -1)] == ["running-when-it-died"]
    assert r.hlen(UNACKED) == 1
