"""Fair share on one thread: the ops a pool holds run one at a time, each time the one fair share picks, with
each op's tenant, weight and cost from the read its delivery made; then the same through a real Celery worker,
every op run once on the pool's one thread and acked."""

from __future__ import annotations

import threading
from typing import Any

import redis

from tests.harness import wait_for
from tests.private_redis import PrivateRedis
from tests.workers.test_clock import batch
from tests.workers.test_lean_tasks import consuming, pool_app, send
from twinkle import blobs
from twinkle.futures import FutureRecord, Op
from twinkle.keys import Keys
from twinkle.ledger.lifecycle import RunInputs
from twinkle.ledger.messages import UNACKED
from workers.fair_share import MIN_OP_COST
from workers.fair_turns import FairTurns, Turn
from workers.lean_tasks import LeanTasks
from workers.prereads import Prereads


class Pool:
    """A FairTurns fed as the consumer feeds it: each op's read kept, then offered; `run_all` takes every turn."""

    def __init__(self) -> None:
        self.prereads = Prereads(Keys(""))
        self.turns = FairTurns(self.prereads)
        self.ran: list[tuple[str, str]] = []  # (model, request id) in the order the turns ran them
        self._ids = 0

    def offer(self, model: str, op: Op = Op.FORWARD_BACKWARD, payload: Any = None, *, owner: str = "",
              weight: float = 1.0, read: bool = True) -> str:
        self._ids += 1
        request_id = f"r{self._ids}"
        if read:
            record = FutureRecord(request_id=request_id, op=op, owner=owner or model, model_id=model, queue="q",
                                  weight=weight)
            self.prereads.keep(request_id, model, RunInputs(record, blobs.dumps(payload), {}))
        self.turns.offer(Turn(lambda: self.ran.append((model, request_id)), request_id, model))
        return request_id

    def run_all(self) -> list[str]:
        while len(self.turns):
            self.turns.next().run()
        return [model for model, _ in self.ran]


def test_a_light_tenants_op_waits_for_at_most_one_op_of_a_heavy_tenants_backlog() -> None:
    pool = Pool()
    for _ in range(8):
        pool.offer("heavy", Op.FORWARD_BACKWARD, batch(4000))
        pool.offer("heavy", Op.OPTIM_STEP)
    for name in ("light1", "light2", "light3", "light4"):
        pool.offer(name, Op.FORWARD_BACKWARD, batch(64))
    order = pool.run_all()
    assert order[0] == "heavy" and set(order[1:5]) == {"light1", "light2", "light3", "light4"}


def test_an_adapters_ops_run_in_the_order_they_were_delivered() -> None:
    pool = Pool()
    ids = {model: [pool.offer(model, Op.FORWARD_BACKWARD if step % 2 == 0 else Op.OPTIM_STEP, batch(size))
                   for step in range(6)] for model, size in (("a", 500), ("b", 10))}
    pool.run_all()
    for model in ("a", "b"):
        assert [request_id for ran_model, request_id in pool.ran if ran_model == model] == ids[model]


def test_backlogged_tenants_get_tokens_in_the_ratio_of_their_weights() -> None:
    pool = Pool()
    for _ in range(40):
        pool.offer("one", Op.FORWARD, batch(100), weight=1)
    for _ in range(40):
        pool.offer("two", Op.FORWARD, batch(100), weight=2)
    first = pool.run_all()[:30]
    assert abs(first.count("two") - 2 * first.count("one")) <= 1, first


def test_a_tenant_back_from_idle_shares_instead_of_spending_banked_credit() -> None:
    pool = Pool()
    for _ in range(1000):
        pool.turns.share.charge("early", 100)
    for _ in range(10):
        pool.offer("early", Op.FORWARD, batch(100))
    for _ in range(10):
        pool.offer("late", Op.FORWARD, batch(100))
    assert pool.run_all()[:6].count("late") <= 4


def test_a_lone_tenant_is_served_in_delivery_order() -> None:
    pool = Pool()
    ids = [pool.offer(f"adapter{i % 3}", Op.FORWARD, batch(1000), owner="solo") for i in range(12)]
    pool.run_all()
    assert [request_id for _, request_id in pool.ran] == ids


def test_an_op_without_a_read_still_runs_charged_the_least_cost() -> None:
    pool = Pool()
    pool.offer("unread", Op.FORWARD_BACKWARD, read=False)
    assert pool.run_all() == ["unread"]
    assert pool.turns.share.served == {"": MIN_OP_COST}


def test_an_op_whose_payload_cannot_be_read_still_gets_its_turn_charged_the_least_cost() -> None:
    pool = Pool()
    request_id = pool.offer("broken", Op.FORWARD_BACKWARD)
    record = FutureRecord(request_id=request_id, op=Op.FORWARD_BACKWARD, owner="t", model_id="broken", queue="q")
    pool.prereads.keep(request_id, "broken", RunInputs(record, b"not a blob", {}))
    assert pool.run_all() == ["broken"]
    assert pool.turns.share.served == {"t": MIN_OP_COST}


def test_a_withdrawn_op_is_not_run_and_one_a_turn_took_cannot_be_withdrawn() -> None:
    pool = Pool()
    first = pool.offer("a")
    second = pool.offer("b")
    taken = pool.turns.next()
    assert taken.request_id == first and not pool.turns.withdraw(first)
    assert pool.turns.withdraw(second) and len(pool.turns) == 0


def test_a_worker_with_fair_turns_runs_every_held_op_once_on_its_one_thread_and_acks_it(
        broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    ran: list[tuple[str, int]] = []
    release = threading.Event()

    def runner(request_id: str, model_id: str, tag: str) -> None:
        release.wait(10)  # the first op holds the thread while the rest are delivered and held
        ran.append((request_id, threading.get_ident()))

    lean = LeanTasks()
    lean.turns = FairTurns(Prereads(Keys("")))
    by_celery: list[str] = []
    celery = pool_app(broker.url, lean, runner, by_celery)
    ids = [f"op-{i}" for i in range(12)]
    celery.conf.worker_prefetch_multiplier = 16  # one thread holding 16 messages, as a pool holds its window
    with consuming(celery, threads=1):
        for request_id in ids:
            send(celery, request_id)
        wait_for(lambda: len(lean.held()) == len(ids))  # all delivered to the one thread's turns at once
        release.set()
        wait_for(lambda: len(ran) == len(ids) and r.hlen(UNACKED) == 0)
    assert [request_id for request_id, _ in ran] == ids  # one model, no reads: delivery order
    assert len({thread for _, thread in ran}) == 1
    assert by_celery == [] and lean.held() == set() and len(lean.turns) == 0
