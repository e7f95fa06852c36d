"""The broker message the API's submit script pushes is the one Celery's own producer would push, and a pool
worker runs the task it names."""

from __future__ import annotations

import json
import threading
import time

import redis
from celery.contrib.testing.worker import start_worker

from tests.private_redis import PrivateRedis
from twinkle.celery_app import make_celery, task_name
from twinkle.ledger.messages import UNACKED
from twinkle.task_message import task_message

QUEUE = "model.task-message-test.0"



def test_the_message_is_the_one_celerys_send_task_pushes_but_for_its_delivery_tag(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    celery = make_celery(broker.url, events=False)
    celery.send_task(task_name("forward_backward"), kwargs={"request_id": "1a23e500000-aaaa", "model_id": "s1:train:0"},
                     queue=QUEUE, task_id="1a23e500000-aaaa")
    [pushed] = r.lrange(QUEUE, 0, -1)
    by_celery = json.loads(pushed)
    ours = json.loads(task_message(celery, "forward_backward", "1a23e500000-aaaa", "s1:train:0", QUEUE))
    assert by_celery["properties"].pop("delivery_tag") != ours["properties"].pop("delivery_tag")
    assert ours == by_celery


def test_two_messages_of_one_op_have_their_own_delivery_tags(broker: PrivateRedis) -> None:
    celery = make_celery(broker.url, events=False)
    first, second = (json.loads(task_message(celery, "optim_step", "1a23e500000-bbbb", "m", QUEUE)) for _ in "12")
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]


def test_a_pool_worker_runs_the_task_of_a_pushed_message_and_acks_it(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    celery = make_celery(broker.url, events=False)
    celery.conf.broker_transport = "workers.handover:HandoverTransport"  # the pool workers' transport
    ran: list[tuple[str, str]] = []
    done = threading.Event()
    name = f"twinkle.test_task_message_{id(ran)}"  # Celery keeps task names process-wide

    @celery.task(name=name)
    def op(request_id: str, model_id: str = "") -> None:
        ran.append((request_id, model_id))
        done.set()

    message = task_message(celery, "optim_step", "1a23e500000-cccc", "s1:train:0", QUEUE)
    r.lpush(QUEUE, message.replace(task_name("optim_step"), name))  # the test's own task, same message
    with start_worker(celery, pool="threads", concurrency=1, queues=[QUEUE], perform_ping_check=False,
                      loglevel="WARNING", shutdown_timeout=10):
        assert done.wait(10)
        deadline = time.time() + 10
        while r.hlen(UNACKED) and time.time() < deadline:
            time.sleep(0.02)
    assert ran == [("1a23e500000-cccc", "s1:train:0")]
    assert r.llen(QUEUE) == 0 and r.hlen(UNACKED) == 0
