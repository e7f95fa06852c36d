"""Each key's share of a pool's broker queue and its parked backlog: the API's admit script and the pool's
release, on a real Redis."""

from __future__ import annotations

import time

import pytest
import redis

from twinkle.backlog import ADMIT, MIN_SHARE, BacklogKeys, BacklogRelease, Parked
from twinkle.futures import FutureRecord
from twinkle.keys import Keys

QUEUE = "model.pool.0"


class Sender:
    """Records what a pool would send; fails on the request ids in `refuse`."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.sent: list[str] = []
        self.refuse = refuse

    def __call__(self, parked: Parked) -> None:
        if parked.request_id in self.refuse:
            raise ConnectionError("broker away")
        self.sent.append(parked.request_id)


def released(release: BacklogRelease, tenant: str, request_id: str) -> list[str]:
    sender = Sender()
    release.finished(tenant, request_id, sender)
    return sender.sent


def admit(r: redis.Redis, keys: Keys, tenant: str, request_id: str, window: int = 8) -> bool:
    sent = r.register_script(ADMIT)(keys=BacklogKeys(keys).of(QUEUE, tenant), args=[
        tenant, request_id, "forward_backward", "m-" + tenant, window, MIN_SHARE, 600, time.time()])
    return bool(int(sent))


def test_a_lone_key_sends_up_to_the_whole_window_then_parks_in_order(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    sent = [admit(r, keys, "flood", f"r{i}") for i in range(12)]
    assert sent == [True] * 8 + [False] * 4
    parked = [Parked.decode(raw) for raw in r.lrange(BacklogKeys(keys).parked(QUEUE, "flood"), 0, -1)]
    assert [p.request_id for p in parked] == ["r8", "r9", "r10", "r11"]
    assert parked[0] == Parked("r8", "forward_backward", "m-flood")


def test_a_second_key_is_sent_at_once_while_the_first_is_parked(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    for i in range(20):
        admit(r, keys, "flood", f"f{i}")
    assert admit(r, keys, "light", "l0")
    # two keys share the window now: the flooding key's share is half of it
    release = BacklogRelease(r, keys, QUEUE, window=8, ttl=600)
    assert released(release, "flood", "f0") == []  # 7 of its ops still sent, more than its share of 4
    for i in range(1, 4):
        assert released(release, "flood", f"f{i}") == []
    # down to 3 sent of its share of 4: each op that ends lets one parked op in, oldest first
    assert released(release, "flood", "f4") == ["f8"]
    assert released(release, "flood", "f5") == ["f9"]


def test_once_a_key_has_parked_ops_its_new_ops_queue_behind_them(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    for i in range(9):
        admit(r, keys, "k", f"r{i}")
    release = BacklogRelease(r, keys, QUEUE, window=8, ttl=600)
    assert released(release, "k", "r0") == ["r8"]
    assert not admit(r, keys, "k", "r9")  # at its share again: parked, never ahead of an older parked op


def test_while_a_pool_sends_released_ops_the_keys_new_ops_park_behind_them(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    for i in range(10):
        admit(r, keys, "k", f"r{i}")
    release = BacklogRelease(r, keys, QUEUE, window=8, ttl=600)
    for i in range(6):
        released(release, "k", f"r{i}")  # r8, r9 sent; the backlog is empty, 4 sent
    seen: list[str] = []

    def send_and_submit(parked: Parked) -> None:
        seen.append(parked.request_id)
        if parked.request_id == "r10":
            # the API accepts a new op while this one is on its way to the broker: it must not overtake it
            assert not admit(r, keys, "k", "new")

    r.rpush(BacklogKeys(keys).parked(QUEUE, "k"), Parked("r10", "forward", "m").encode())
    release.finished("k", "r6", send_and_submit)
    assert seen == ["r10", "new"]  # the op parked meanwhile followed it, in order


def test_the_sweep_forgets_ops_that_ended_elsewhere_and_releases_their_room(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    for i in range(10):
        rid = f"r{i}"
        r.hset(keys.future(rid), mapping=FutureRecord(rid, "forward", "k", "m", QUEUE).to_hash())
        admit(r, keys, "k", rid)
    r.hset(keys.future("r0"), "status", "failed")  # a lost request, failed by the API
    r.delete(keys.future("r1"))  # expired
    sender = Sender()
    assert BacklogRelease(r, keys, QUEUE, window=8, ttl=600).sweep(sender) == 2
    assert sender.sent == ["r8", "r9"]
    assert r.smembers(BacklogKeys(keys).waiting(QUEUE)) == set()


def test_an_op_that_could_not_be_sent_goes_back_to_the_head_with_the_ones_after_it(
        redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    for i in range(12):
        admit(r, keys, "k", f"r{i}")
    release = BacklogRelease(r, keys, QUEUE, window=8, ttl=600)
    for i in range(2):
        r.zrem(BacklogKeys(keys).sent(QUEUE, "k"), f"r{i}")  # two ended: room for r8 and r9
    with pytest.raises(ConnectionError):
        release.finished("k", "r2", Sender(refuse=("r9",)))  # r8 sent, r9 refused: r9, r10, r11 back
    assert [Parked.decode(raw).request_id for raw in r.lrange(BacklogKeys(keys).parked(QUEUE, "k"), 0, -1)] == [
        "r9", "r10", "r11"]
    assert not admit(r, keys, "k", "r12")  # still behind them
    assert released(release, "k", "r3") == ["r9", "r10", "r11"]


def test_a_pool_without_a_window_sends_everything(redis_keys: tuple[redis.Redis, Keys]) -> None:
    r, keys = redis_keys
    assert all(admit(r, keys, "k", f"r{i}", window=0) for i in range(100))
