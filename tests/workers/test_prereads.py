"""A pool whose every delivered op gets a thread at once reads the op's record, payload and model in the round trip
that records the delivery; the op's thread takes that read once, for the model its message named, instead of
reading again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from tests.harness import redis_sends
from tests.private_redis import PrivateRedis
from twinkle import blobs
from twinkle.celery_app import make_celery
from twinkle.futures import FutureRecord, FutureStatus, Op
from twinkle.keys import Keys
from twinkle.ledger.lifecycle import RunInputs
from twinkle.records import ModelRecord
from workers import handover, prereads
from workers.prereads import Prereads
from workers.runtime import PoolRuntime

QUEUE = "model.preread-test.0"
MODEL = "s1:train:0"
KEYS = Keys("tw:")


class Message:
    """What the consumer hands over: a message whose body decodes to Celery's (args, kwargs, embed)."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def decode(self) -> Any:
        return self.body


def stored_op(r: redis.Redis, request_id: str, payload: bytes = blobs.dumps({"lr": 0.1})) -> FutureRecord:
    rec = FutureRecord(request_id=request_id, op=Op.OPTIM_STEP, owner="t", model_id=MODEL, queue=QUEUE,
                       created_at=time.time())
    r.hset(KEYS.future(request_id), mapping=rec.to_hash())
    r.set(KEYS.blob_in(request_id), payload)
    r.hset(KEYS.model(MODEL), mapping=ModelRecord(MODEL, "t", "s1", "tiny", "app", QUEUE).to_hash())
    return rec


@pytest.fixture
def kept() -> Iterator[Prereads]:
    handover.PREREADS = Prereads(KEYS)
    yield handover.PREREADS
    handover.PREREADS = None


def test_a_delivered_ops_read_is_kept_for_its_thread_and_taken_once(broker: PrivateRedis, kept: Prereads) -> None:
    r = redis.Redis.from_url(broker.url)
    stored_op(r, "op-1")
    celery = make_celery(broker.url, events=False)
    celery.conf.broker_transport = "workers.handover:HandoverTransport"
    taken: list[RunInputs | None] = []
    done = threading.Event()

    @celery.task(name="twinkle.test_preread")
    def run(request_id: str, model_id: str = "") -> None:
        taken.append(kept.take(request_id, model_id))
        taken.append(kept.take(request_id, model_id))
        done.set()

    celery.send_task("twinkle.test_preread", kwargs={"request_id": "op-1", "model_id": MODEL}, queue=QUEUE)
    with start_worker(celery, pool="threads", concurrency=1, queues=[QUEUE], perform_ping_check=False,
                      loglevel="WARNING", shutdown_timeout=10):
        assert done.wait(10)
    first, again = taken
    assert first is not None and again is None
    assert first.record is not None and first.record.request_id == "op-1"
    assert first.payload is not None and blobs.loads(first.payload) == {"lr": 0.1}
    assert ModelRecord.from_hash(first.model).model_id == MODEL
    assert len(kept) == 0


def test_a_read_is_taken_only_for_the_model_its_message_named() -> None:
    kept = Prereads(KEYS)
    inputs = RunInputs(None, None, {})
    kept.keep("op-1", MODEL, inputs)
    assert kept.take("op-1", "another:model") is None and kept.take("op-1", MODEL) is None  # gone with the first
    kept.keep("op-2", MODEL, inputs)
    assert kept.take("op-2", MODEL) is inputs


def test_reads_no_thread_took_age_out_beyond_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prereads, "LIMIT", 3)
    kept = Prereads(KEYS)
    for index in range(5):
        kept.keep(f"op-{index}", MODEL, RunInputs(None, None, {}))
    assert len(kept) == 3 and kept.take("op-0", MODEL) is None and kept.take("op-4", MODEL) is not None


def test_a_message_that_is_not_a_twinkle_op_gets_no_read() -> None:
    kept = Prereads(KEYS)
    assert kept.read_for(Message([["x"], {}, {}])) is None and kept.read_for(Message("not a task")) is None
    request_id, model_id, _ = kept.read_for(Message([[], {"request_id": "op-1"}, {}])) or ("", "", None)
    assert (request_id, model_id) == ("op-1", "")


def test_a_runtime_with_a_kept_read_reads_nothing_before_it_begins(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    stored_op(r, "op-1")
    ran: list[Any] = []

    def optim_step(_rec: FutureRecord, payload: Any) -> dict[str, Any]:
        ran.append(payload)
        return {}

    runtime = PoolRuntime(r, KEYS, QUEUE, {Op.OPTIM_STEP: optim_step}, future_ttl=60)
    runtime.prereads = Prereads(KEYS)
    read = runtime.prereads.read_for(Message([[], {"request_id": "op-1", "model_id": MODEL}, {}]))
    assert read is not None
    runtime.prereads.keep("op-1", MODEL, runtime.futures.run(read[2]))
    with redis_sends() as commands:
        runtime.execute(Op.OPTIM_STEP, "op-1", MODEL)
    assert ran == [{"lr": 0.1}]  # the handler got the kept payload
    assert b"HGETALL" not in b"".join(part for command in commands for part in (
        command if isinstance(command, list) else [command]))
    assert FutureRecord.from_hash(r.hgetall(KEYS.future("op-1"))).state is FutureStatus.COMPLETED
