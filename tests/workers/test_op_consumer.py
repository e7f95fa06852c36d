"""A model pool's own consumer: it takes the messages the API pushes, runs each op once on its one thread with
its ids and delivery tag, acks it after, publishes what it holds, survives the broker going away, and on a warm
stop puts back what it held, in order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis

from tests.harness import wait_for
from tests.private_redis import PrivateRedis
from twinkle.celery_app import make_celery, task_name
from twinkle.futures import Op
from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX, handover_key
from twinkle.task_message import task_message
from workers.fair_turns import FairTurns
from workers.op_consumer import OpConsumer
from workers.prereads import Prereads

QUEUE = "model.consumer-test.0"


class Ops:
    """What the runner saw of each op: (request id, model id, delivery tag, unacked entries then, thread)."""

    def __init__(self, r: redis.Redis, hold: threading.Event | None = None) -> None:
        self.r = r
        self.hold = hold  # the first op waits for it
        self.ran: list[tuple[str, str, str, int, int]] = []
        self.held_while_running: list[set[str]] = []
        self.consumer: OpConsumer | None = None

    def run(self, request_id: str, model_id: str, tag: str) -> None:
        assert self.consumer is not None
        self.held_while_running.append(self.consumer.held())
        if self.hold is not None and not self.ran:
            self.hold.wait(10)
        self.ran.append((request_id, model_id, tag, int(self.r.hlen(UNACKED)), threading.get_ident()))

    def ids(self) -> list[str]:
        return [request_id for request_id, *_ in self.ran]


def push(r: redis.Redis, *request_ids: str, op: Op = Op.FORWARD_BACKWARD) -> None:
    """LPUSH each op's message onto the queue as the API's submit script does."""
    celery = make_celery(f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0", events=False)
    for request_id in request_ids:
        r.lpush(QUEUE, task_message(celery, op, request_id, "m1", QUEUE))


@contextmanager
def consuming(url: str, ops: Ops, *, fair: bool = False, window: int = 1) -> Iterator[OpConsumer]:
    prereads = Prereads(Keys(""))
    runners: dict[str, Callable[[str, str, str], None]] = {task_name(op): ops.run for op in Op}
    consumer = OpConsumer(redis.Redis.from_url(url, socket_timeout=6, socket_connect_timeout=1), QUEUE,
                          runners, acked_by_finish=set(), prereads=prereads,
                          turns=FairTurns(prereads) if fair else None, window=window)
    ops.consumer = consumer
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        yield consumer
    finally:
        consumer.stop()
        thread.join(10)
        assert not thread.is_alive(), "the consumer stops within its pop's wait"


@pytest.fixture
def r(broker: PrivateRedis) -> redis.Redis:
    return redis.Redis.from_url(broker.url)


def test_each_op_runs_once_in_queue_order_with_its_ids_and_tag_and_is_acked_after_it(
        broker: PrivateRedis, r: redis.Redis) -> None:
    ops = Ops(r)
    with consuming(broker.url, ops) as consumer:
        push(r, "op-1", "op-2", "op-3")
        push(r, "op-4", op=Op.OPTIM_STEP)
        wait_for(lambda: len(ops.ran) == 4 and r.hlen(UNACKED) == 0)
    assert ops.ids() == ["op-1", "op-2", "op-3", "op-4"]
    assert all(model_id == "m1" and len(tag) == 36 for _, model_id, tag, _, _ in ops.ran)  # the message's own tag
    assert all(unacked == 1 for *_, unacked, _ in ops.ran)  # recorded as delivered while it ran, acked after
    assert len({thread for *_, thread in ops.ran}) == 1
    assert consumer.held() == set() and r.zcard(UNACKED_INDEX) == 0 and r.llen(handover_key(QUEUE)) == 0


def test_an_op_is_held_from_its_pop_until_it_finished(broker: PrivateRedis, r: redis.Redis) -> None:
    hold = threading.Event()
    ops = Ops(r, hold)
    with consuming(broker.url, ops) as consumer:
        push(r, "op-1")
        wait_for(lambda: ops.held_while_running == [{"op-1"}])
        assert consumer.held() == {"op-1"}  # what the heartbeat publishes for the orphan sweep
        hold.set()
        wait_for(lambda: ops.ids() == ["op-1"])
        wait_for(lambda: consumer.held() == set())


def test_with_fair_turns_it_takes_its_window_and_runs_every_op_once_on_its_one_thread(
        broker: PrivateRedis, r: redis.Redis) -> None:
    ids = [f"op-{i}" for i in range(12)]
    push(r, *ids)
    ops = Ops(r)
    with consuming(broker.url, ops, fair=True, window=16):
        wait_for(lambda: len(ops.ran) == len(ids) and r.hlen(UNACKED) == 0)
    assert set(ops.held_while_running[0]) == set(ids)  # all taken before the first pick
    assert ops.ids() == ids  # one model, no future records: delivery order
    assert len({thread for *_, thread in ops.ran}) == 1


def test_a_window_is_taken_no_further_than_its_size(broker: PrivateRedis, r: redis.Redis) -> None:
    ids = [f"op-{i}" for i in range(6)]
    push(r, *ids)
    ops = Ops(r)
    with consuming(broker.url, ops, fair=True, window=4):
        wait_for(lambda: len(ops.ran) == len(ids))
    assert len(ops.held_while_running[0]) == 4 and ops.ids() == ids


def test_what_a_lost_connection_left_in_the_handover_list_runs_first(broker: PrivateRedis, r: redis.Redis) -> None:
    push(r, "op-1", "op-2")
    r.lmove(QUEUE, handover_key(QUEUE), "RIGHT", "LEFT")  # popped by a consumer whose connection broke
    ops = Ops(r)
    with consuming(broker.url, ops):
        wait_for(lambda: len(ops.ran) == 2)
    assert ops.ids() == ["op-1", "op-2"] and r.llen(handover_key(QUEUE)) == 0


def test_a_message_that_is_no_op_is_dropped_and_the_next_one_runs(broker: PrivateRedis, r: redis.Redis) -> None:
    r.lpush(QUEUE, b"not a message")
    push(r, "op-1")
    ops = Ops(r)
    with consuming(broker.url, ops):
        wait_for(lambda: ops.ids() == ["op-1"] and r.hlen(UNACKED) == 0)
    assert r.llen(handover_key(QUEUE)) == 0 and r.llen(QUEUE) == 0


def test_a_warm_stop_lets_the_running_op_finish_and_puts_the_held_ones_back_at_the_head_in_order(
        broker: PrivateRedis, r: redis.Redis) -> None:
    push(r, "op-1", "op-2", "op-3", "op-4")
    hold = threading.Event()
    ops = Ops(r, hold)
    with consuming(broker.url, ops, fair=True, window=8) as consumer:
        wait_for(lambda: len(ops.held_while_running) == 1)
        consumer.stop()
        hold.set()
    assert ops.ids() == ["op-1"]
    assert r.hlen(UNACKED) == 0 and r.zcard(UNACKED_INDEX) == 0
    push(r, "op-5")  # behind them
    ops = Ops(r)
    with consuming(broker.url, ops):
        wait_for(lambda: len(ops.ran) == 4)
    assert ops.ids() == ["op-2", "op-3", "op-4", "op-5"]


def test_it_consumes_again_once_a_broker_outage_is_over(broker: PrivateRedis, r: redis.Redis) -> None:
    ops = Ops(r)
    with consuming(broker.url, ops):
        push(r, "op-1")
        wait_for(lambda: ops.ids() == ["op-1"] and r.hlen(UNACKED) == 0)
        broker.outage(1.5)
        r = redis.Redis.from_url(broker.url)
        ops.r = r
        push(r, "op-2")
        wait_for(lambda: ops.ids() == ["op-1", "op-2"] and r.hlen(UNACKED) == 0, timeout=15)
