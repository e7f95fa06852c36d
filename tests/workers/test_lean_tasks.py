"""Where nothing watches Celery's task layer, an op's message goes from the consumer straight to the pool's
threads: its runner gets the ids and the delivery tag, the message is acked after it, and anything unusual
still goes through Celery's own strategy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from tests.harness import wait_for
from tests.private_redis import PrivateRedis
from twinkle.celery_app import make_celery
from twinkle.ledger.messages import UNACKED
from workers.handover import HandoverQoS
from workers.lean_tasks import LeanTasks

QUEUE = "model.lean-test.0"


def pool_app(url: str, lean: LeanTasks, runner: Callable[[str, str, str], None], by_celery: list[str]) -> Celery:
    """A pool-like app with one op task taken by `lean`; the task's own body (Celery's path) notes its id."""
    celery = make_celery(url, events=False)
    celery.conf.broker_transport = "workers.handover:HandoverTransport"
    name = f"twinkle.test_lean_{id(lean)}"  # Celery keeps task names process-wide
    lean.runners[name] = runner

    def task(self: Any, request_id: str, model_id: str = "") -> None:
        by_celery.append(request_id)

    celery.task(name=name, bind=True, ignore_result=True, Strategy=lean.strategy)(task)
    celery.conf.op_task = name
    return celery


def send(celery: Celery, request_id: str, **options: Any) -> None:
    celery.send_task(celery.conf.op_task, kwargs={"request_id": request_id, "model_id": "m1"}, queue=QUEUE,
                     task_id=request_id, **options)


def consuming(celery: Celery, threads: int = 2) -> Any:
    return start_worker(celery, pool="threads", concurrency=threads, queues=[QUEUE], perform_ping_check=False,
                        loglevel="WARNING", shutdown_timeout=10)


def test_an_op_message_reaches_its_runner_with_its_ids_and_tag_and_is_acked_after_it(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    received: list[tuple[str, str]] = []
    ran: list[tuple[str, str, str, int]] = []
    lean = LeanTasks(received=lambda request_id, model_id: received.append((request_id, model_id)))
    by_celery: list[str] = []
    celery = pool_app(broker.url, lean,
                      lambda rid, mid, tag: ran.append((rid, mid, tag, int(r.hlen(UNACKED)))), by_celery)
    with consuming(celery):
        send(celery, "op-1")
        send(celery, "op-2")
        wait_for(lambda: len(ran) == 2 and r.hlen(UNACKED) == 0)
    assert received == [("op-1", "m1"), ("op-2", "m1")]
    assert sorted(rid for rid, *_ in ran) == ["op-1", "op-2"] and all(mid == "m1" for _, mid, _, _ in ran)
    assert all(len(tag) == 36 for *_, tag, _ in ran)  # kombu's delivery tag, which a finish acknowledges
    assert all(unacked >= 1 for *_, unacked in ran)  # its message stayed unacked while it ran
    assert by_celery == [] and lean.held() == set()


def test_an_op_message_is_acked_in_the_ops_own_thread_without_a_turn_of_the_consumers_loop(
        broker: PrivateRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    acked_in: list[int] = []
    ran_in: list[int] = []
    ack = HandoverQoS.ack

    def recorded(qos: HandoverQoS, delivery_tag: str) -> None:
        acked_in.append(threading.get_ident())
        ack(qos, delivery_tag)

    monkeypatch.setattr(HandoverQoS, "ack", recorded)
    celery = pool_app(broker.url, LeanTasks(), lambda *_: ran_in.append(threading.get_ident()), [])
    with consuming(celery):
        send(celery, "op-1")
        send(celery, "op-2")
        wait_for(lambda: len(acked_in) == 2)
    assert sorted(acked_in) == sorted(ran_in)


def test_a_consumer_stopped_at_its_prefetch_limit_fetches_again_as_soon_as_an_ack_frees_a_slot(
        broker: PrivateRedis) -> None:
    ran: list[str] = []
    celery = pool_app(broker.url, LeanTasks(), lambda rid, *_: ran.append(rid), [])
    celery.conf.worker_prefetch_multiplier = 1  # one thread, one message in hand: every ack frees the only slot
    ops = [f"op-{i}" for i in range(6)]
    with consuming(celery, threads=1):
        started = time.monotonic()
        for rid in ops:
            send(celery, rid)
        wait_for(lambda: len(ran) == len(ops))
        # Unwoken, the consumer would look again only at its next timer, about a second per op.
        assert time.monotonic() - started < 3
    assert ran == ops


def test_the_ids_of_messages_in_hand_are_held_until_their_ack(broker: PrivateRedis) -> None:
    gate = threading.Event()

    def waits(*_: str) -> None:
        gate.wait(10)

    lean = LeanTasks()
    celery = pool_app(broker.url, lean, waits, [])
    with consuming(celery):
        send(celery, "op-1")
        wait_for(lambda: lean.held() == {"op-1"})
        gate.set()
        wait_for(lambda: lean.held() == set())


def test_a_runner_that_raises_still_has_its_message_acked(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    calls: list[str] = []

    def broken(request_id: str, *_: str) -> None:
        calls.append(request_id)
        raise RuntimeError("a bug")

    lean = LeanTasks()
    celery = pool_app(broker.url, lean, broken, [])
    with consuming(celery):
        send(celery, "op-1")
        wait_for(lambda: calls == ["op-1"] and r.hlen(UNACKED) == 0)
    assert lean.held() == set()


def test_a_message_with_an_eta_goes_through_celerys_own_strategy(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    ran: list[str] = []
    by_celery: list[str] = []
    celery = pool_app(broker.url, LeanTasks(), lambda rid, *_: ran.append(rid), by_celery)
    with consuming(celery):
        send(celery, "op-later", countdown=0.2)
        send(celery, "op-now")
        wait_for(lambda: by_celery == ["op-later"] and ran == ["op-now"] and r.hlen(UNACKED) == 0)


def test_only_a_pool_of_threads_nobody_watches_skips_celerys_task_layer() -> None:
    assert LeanTasks.wanted(watched=False, threads=True)
    assert not LeanTasks.wanted(watched=True, threads=True)  # Flower's events, telemetry's signals
    assert not LeanTasks.wanted(watched=False, threads=False)  # prefork children run Celery's own
