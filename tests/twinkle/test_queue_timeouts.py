"""The queue_timeout sweep: ops past their queue's timeout fail while still queued, wherever their message waits
(the broker queue, a worker's unacked messages, a key's backlog), and nothing else is touched; real Redis of the
test's own (kombu's keys have no prefix)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from tests.harness import mock_config
from tests.twinkle.test_queued_ops import KEYS, QUEUE, hold, park, publish, record, request_id, status
from twinkle.backlog import BacklogKeys, Parked
from twinkle.catalog import Catalog
from twinkle.config import ServerConfig
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.queue_timeouts import SWEEP_SECONDS, QueueTimeoutSweep, timeouts_by_queue


@pytest.fixture
def r(private_client: redis.Redis) -> redis.Redis:
    return private_client


def queued(r: redis.Redis, age: float, where: str, *, queue: str = QUEUE, state: str = FutureStatus.QUEUED) -> str:
    """An op accepted `age` seconds ago whose message is `where`: in the queue, held, or parked."""
    rid = request_id(age)
    if where == "parked":
        park(r, rid, queue=queue)
    else:
        publish(r, rid, queue=queue)  # first: a process's first Celery publish can take most of a second
        if where == "held":
            hold(r, rid, queue=queue)
    record(r, rid, age=age, queue=queue, status=state)  # its age then holds to the second when the sweep reads it
    return rid


def test_ops_past_their_queue_timeout_fail_while_queued_wherever_their_message_waits(r: redis.Redis) -> None:
    late = {where: queued(r, 30, where) for where in ("queue", "held", "parked")}
    prompt = {where: queued(r, 1, where) for where in ("queue", "held", "parked")}
    running = queued(r, 30, "held", state=FutureStatus.RUNNING)  # a worker began it: its outcome is the worker's
    patient = queued(r, 30, "queue", queue="model.patient.0")  # a queue with a longer timeout
    sweep = QueueTimeoutSweep(r, KEYS, {QUEUE: 5, "model.patient.0": 60, "model.forever.0": 0}, ttl=600)
    assert sweep.sweep() == 3
    for rid in late.values():
        failed = FutureRecord.from_hash(r.hgetall(KEYS.future(rid)))
        assert (failed.status, failed.code, failed.category) == ("failed", "queue_timeout", "server")
        assert f"forward waited 30 s in the queue of {QUEUE}, longer than its queue_timeout of 5 s" in failed.error
    assert [status(r, rid) for rid in prompt.values()] == ["queued"] * 3
    assert status(r, running) == "running" and status(r, patient) == "queued"
    # the late parked op left its key's backlog (nothing sends it later); the prompt one is still there
    parked = [Parked.decode(raw).request_id for raw in r.lrange(BacklogKeys(KEYS).parked(QUEUE, "t"), 0, -1)]
    assert parked == [prompt["parked"]]
    assert sweep.sweep() == 0  # each fails once


def test_one_api_process_of_many_sweeps_a_round(r: redis.Redis) -> None:
    first, second = (QueueTimeoutSweep(r, KEYS, {QUEUE: 5}, ttl=600) for _ in range(2))
    assert first.my_round() and not second.my_round()
    time.sleep(SWEEP_SECONDS)
    assert second.my_round()


def test_every_model_replica_and_sampler_queue_has_its_pools_timeout_and_processor_queues_none() -> None:
    config = ServerConfig.model_validate(mock_config(Path("/models/tiny"), Path("/ckpt"), port=1, db=0, sampler=True,
                                                     processor=True, replicas=2, queue_config={"queue_timeout": 7}))
    assert timeouts_by_queue(config, Catalog(config)) == {
        "model.models-tiny.0": 7.0, "model.models-tiny.1": 7.0, "sampler.sampler-tiny": 300.0}
    forever = ServerConfig.model_validate(mock_config(Path("/models/tiny"), Path("/ckpt"), port=1, db=0,
                                                      queue_config={"queue_timeout": 0}))
    assert timeouts_by_queue(forever, Catalog(forever)) == {}
