"""A pool's reservation by a full-parameter run, on a Redis of the module's own (the pool queue has no key prefix)."""

from __future__ import annotations

import json
import time

import pytest
import redis

from twinkle.errors import PoolReserved
from twinkle.futures import FutureRecord
from twinkle.keys import Keys
from twinkle.pool_reservation import PoolReservation, Reservation, end_by_operator, renew

QUEUE = "model.tiny.0"
KEYS = Keys("t:")


def op(request_id: str, model_id: str) -> FutureRecord:
    return FutureRecord(request_id=request_id, op="forward", owner="alice", model_id=model_id, queue=QUEUE)


@pytest.fixture
def reservation(private_client: redis.Redis) -> PoolReservation:
    held = PoolReservation(private_client, KEYS, QUEUE, lease_seconds=30)
    held.message_for = lambda op_name, rid, mid: json.dumps({"op": op_name, "id": rid, "model": mid})
    return held


def delivery_order(r: redis.Redis) -> list[str]:
    """The queue's messages in the order its consumer (popping from the right) gets them."""
    return [json.loads(raw)["id"] for raw in reversed(r.lrange(QUEUE, 0, -1))]


def test_other_runs_ops_park_and_go_back_to_the_head_of_the_queue_oldest_first_when_the_hold_ends(
        reservation: PoolReservation, private_client: redis.Redis) -> None:
    reservation.take(op("c1", "full-run"), "s1")
    private_client.lpush(QUEUE, json.dumps({"id": "later"}))  # submitted meanwhile, not yet delivered
    assert not reservation.diverts(op("f1", "full-run"))
    assert reservation.diverts(op("s1", ""))  # a sample of a sampler checkpoint would use the changed weights
    for rid in ("a1", "b1", "a2"):
        assert reservation.diverts(op(rid, rid[0]))
        assert reservation.park("forward", op(rid, rid[0]))
    assert private_client.lpos(KEYS.reservation_parked_ids(QUEUE), "a2") == 2

    assert reservation.end("unloaded") == 3
    assert delivery_order(private_client) == ["a1", "b1", "a2", "later"]
    assert reservation.read() is None and reservation.holder is None
    assert not reservation.park("forward", op("a3", "a"))  # nothing holds the pool: it runs now


def test_a_second_run_cannot_take_a_held_pool_but_takes_one_whose_lease_ran_out(
        reservation: PoolReservation, private_client: redis.Redis) -> None:
    reservation.take(op("c1", "first"), "s1")
    other = PoolReservation(private_client, KEYS, QUEUE, lease_seconds=30)
    with pytest.raises(PoolReserved, match="reserved by a full-parameter run until") as refused:
        other.take(op("c2", "second"), "s2")
    assert refused.value.details["holder"] == "first" and refused.value.status_code == 423
    private_client.hset(KEYS.pool_reservation(QUEUE), "expires_at", time.time() - 1)
    other.take(op("c2", "second"), "s2")
    assert other.read().holder == "second"  # type: ignore[union-attr]


def test_a_renewal_extends_only_the_holders_lease(reservation: PoolReservation, private_client: redis.Redis) -> None:
    reservation.take(op("c1", "full-run"), "s1")
    private_client.hset(KEYS.pool_reservation(QUEUE), "expires_at", time.time() + 1)
    assert not renew(private_client, KEYS, QUEUE, "somebody-else")
    assert reservation.read().expires_at < time.time() + 2  # type: ignore[union-attr]
    assert renew(private_client, KEYS, QUEUE, "full-run")
    assert reservation.read().expires_at > time.time() + 25  # type: ignore[union-attr]


def test_the_tick_ends_a_hold_whose_lease_ran_out_or_an_operator_ended_and_frees_the_pool(
        reservation: PoolReservation, private_client: redis.Redis) -> None:
    ended: list[tuple[str, str]] = []
    reservation.end_run = lambda model_id, why: ended.append((model_id, why))
    reservation.take(op("c1", "run-1"), "s1")
    assert reservation.tick() == ""  # still held
    private_client.hset(KEYS.pool_reservation(QUEUE), "expires_at", time.time() - 1)
    reservation.park("forward", op("w1", "lora"))
    assert "ended the full-parameter run run-1" in reservation.tick()
    assert ended == [("run-1", "no op and no session heartbeat came for 30 s")]
    assert delivery_order(private_client) == ["w1"]

    reservation.take(op("c2", "run-2"), "s2")
    assert end_by_operator(private_client, KEYS, QUEUE, "an operator ended it").holder == "run-2"  # type: ignore[union-attr]
    reservation.tick()
    assert ended[-1] == ("run-2", "an operator ended it") and reservation.read() is None


def test_a_hold_a_previous_worker_left_is_cleared_at_once(private_client: redis.Redis) -> None:
    before = PoolReservation(private_client, KEYS, QUEUE, lease_seconds=30)
    before.message_for = lambda op_name, rid, mid: json.dumps({"id": rid})
    before.take(op("c1", "died-with-its-worker"), "s1")
    before.park("forward", op("w1", "lora"))
    restarted = PoolReservation(private_client, KEYS, QUEUE, lease_seconds=30)
    assert "1 ops back in queue" in restarted.tick()
    assert delivery_order(private_client) == ["w1"] and restarted.read() is None


def test_a_pool_that_refuses_fails_other_runs_ops_naming_the_end_of_the_hold(private_client: redis.Redis) -> None:
    refusing = PoolReservation(private_client, KEYS, QUEUE, lease_seconds=30, refuse=True)
    refusing.message_for = lambda op_name, rid, mid: rid
    refusing.take(op("c1", "full-run"), "s1")
    with pytest.raises(PoolReserved, match="until 20"):
        refusing.park("forward", op("w1", "lora"))
    assert private_client.llen(KEYS.reservation_parked(QUEUE)) == 0


def test_a_capped_hold_is_over_at_its_cap_however_often_it_is_renewed() -> None:
    now = time.time()
    capped = Reservation("run", "alice", "s", now - 100, now + 60, now - 1, 60, "")
    assert capped.over(now) == "it reached the pool's max_hold_seconds" and capped.until == now - 1
