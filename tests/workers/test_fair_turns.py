"""Fair share on one thread: the ops a pool holds run one at a time, each time the one fair share picks, with
each op's tenant, weight and cost from the read its delivery made (through a real queue:
tests/workers/test_op_consumer.py)."""

from __future__ import annotations

from typing import Any

from tests.workers.test_clock import batch
from twinkle import blobs
from twinkle.futures import FutureRecord, Op
from twinkle.keys import Keys
from twinkle.ledger.lifecycle import RunInputs
from workers.fair_share import MIN_OP_COST
from workers.fair_turns import FairTurns, Turn
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
