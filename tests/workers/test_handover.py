"""A pool's consumer pops into a handover list and records the message as unacked in one script, so a broker
killed between the two loses nothing: what the list holds goes back to the head of the queue."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu.utils import json as kombu_json

from tests.harness import wait_for
from tests.private_redis import PrivateRedis
from twinkle.celery_app import make_celery
from twinkle.ledger import SyncLedger, scripts
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX, handover_key, restore_unacked
from workers.handover import ACKED_BY_FINISH

QUEUE = "model.handover-test.0"



def app_with_task(url: str, ran: list[str], gate: threading.Event | None = None, *,
                  acked_by_finish: list[str] | None = None) -> Celery:
    """A pool-like app whose task notes its argument; with `acked_by_finish` it reports its message acknowledged,
    as a finished op's script does (without removing the entry, so that a write by the consumer's ack shows)."""
    celery = make_celery(url, events=False)
    celery.conf.broker_transport = "workers.handover:HandoverTransport"

    celery.conf.note_task = f"twinkle.test_note_{id(ran)}"  # Celery keeps task names process-wide

    @celery.task(name=celery.conf.note_task, bind=True)
    def note(self: Any, name: str) -> None:
        if gate is not None:
            gate.wait(10)
        if acked_by_finish is not None:
            acked_by_finish.append(self.request.properties["delivery_tag"])
            ACKED_BY_FINISH.add(acked_by_finish[-1])
        ran.append(name)

    return celery


def send(celery: Celery, name: str) -> None:
    celery.send_task(celery.conf.note_task, args=[name], queue=QUEUE)


def consuming(celery: Celery) -> Any:
    return start_worker(celery, pool="threads", concurrency=1, queues=[QUEUE], perform_ping_check=False,
                        loglevel="WARNING", shutdown_timeout=10)


def test_a_message_popped_but_never_recorded_goes_back_to_the_head_and_runs_first(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    ran: list[str] = []
    celery = app_with_task(broker.url, ran)
    send(celery, "stranded")
    send(celery, "next")
    r.lmove(QUEUE, handover_key(QUEUE), "RIGHT", "LEFT")  # what a broker killed mid-handover leaves behind
    assert r.llen(handover_key(QUEUE)) == 1
    with consuming(celery):
        wait_for(lambda: len(ran) == 2)
    assert ran == ["stranded", "next"]
    assert r.llen(handover_key(QUEUE)) == 0 and r.hlen(UNACKED) == 0


def test_a_delivered_message_is_unacked_until_done_and_never_left_in_the_handover_list(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    ran: list[str] = []
    gate = threading.Event()
    celery = app_with_task(broker.url, ran, gate)
    send(celery, "held")
    [message] = r.lrange(QUEUE, 0, -1)
    with consuming(celery):
        wait_for(lambda: r.hlen(UNACKED) == 1)
        assert r.llen(handover_key(QUEUE)) == 0 and r.llen(QUEUE) == 0
        [entry] = r.hvals(UNACKED)
        assert entry.decode() == kombu_json.dumps([json.loads(message), "", QUEUE])  # as kombu's own QoS writes it
        gate.set()
        wait_for(lambda: ran == ["held"] and r.hlen(UNACKED) == 0)
    assert r.zcard(UNACKED_INDEX) == 0


def test_the_consumers_ack_of_a_message_its_finish_acknowledged_writes_nothing_and_frees_the_prefetch_slot(
        broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    ran: list[str] = []
    tags: list[str] = []
    celery = app_with_task(broker.url, ran, acked_by_finish=tags)
    with consuming(celery):
        for name in ("first", "second", "third"):
            send(celery, name)
        # each ack let the consumer take the next message, and took the tag the finish left
        wait_for(lambda: len(ran) == 3 and not ACKED_BY_FINISH.intersection(tags))
    assert ran == ["first", "second", "third"]
    assert r.hlen(UNACKED) == 3 and r.zcard(UNACKED_INDEX) == 3  # left as they were: no ack wrote to Redis


def test_restoring_a_dead_workers_queue_puts_its_unacked_messages_ahead_of_its_handed_over_one(
        broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    unacked_payload = {"headers": {"id": "1a23e500000-aaaa"}, "body": "older"}
    r.hset(UNACKED, "tag-1", json.dumps([unacked_payload, "", QUEUE]))
    r.zadd(UNACKED_INDEX, {"tag-1": time.time()})
    r.lpush(handover_key(QUEUE), b"handed-over")
    assert restore_unacked(r, QUEUE) == 2
    head_first = list(reversed(r.lrange(QUEUE, 0, -1)))  # consumers take from the right
    assert json.loads(head_first[0]) == unacked_payload and head_first[1] == b"handed-over"
    assert r.llen(handover_key(QUEUE)) == 0 and r.hlen(UNACKED) == 0


def test_a_channel_uses_one_redis_client_for_its_commands_until_its_connections_are_dropped(
        broker: PrivateRedis) -> None:
    celery = app_with_task(broker.url, [])
    with celery.connection_for_read() as connection:
        channel = connection.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second  # redis-py's client costs a table of ~170 callbacks to build
            assert first.ping()
        channel._disconnect_pools()  # what a fork or a lost connection does: a new pool, a new client
        with channel.conn_or_acquire() as third:
            assert third is not first and third.ping()


def test_a_delivery_whose_record_reply_was_lost_is_recorded_again_and_runs_at_once(
        broker: PrivateRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    r = redis.Redis.from_url(broker.url)
    ran: list[str] = []
    original = SyncLedger.run
    lost: list[str] = []

    def reply_lost_once(self: SyncLedger, call: Any) -> Any:
        answer = original(self, call)  # the broker ran it...
        if call.script == scripts.RECORD_DELIVERY and not lost:
            lost.append("once")
            raise redis.ConnectionError("connection lost before the reply")  # ...and the reply never came
        return answer

    monkeypatch.setattr(SyncLedger, "run", reply_lost_once)
    celery = app_with_task(broker.url, ran)
    with consuming(celery):
        send(celery, "recorded")
        wait_for(lambda: ran == ["recorded"] and r.hlen(UNACKED) == 0, timeout=4)  # not after an orphan sweep
    assert lost == ["once"] and r.llen(handover_key(QUEUE)) == 0 and r.llen(QUEUE) == 0
