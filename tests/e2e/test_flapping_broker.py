"""A broker that goes down and up ten times, 1-3 s apart, while a tenant trains: the pool worker never exits,
keeps its adapter, and every op runs exactly once (a Redis of the test's own, appendonly as in production)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_foundation import datum, fb_body, new_model
from tests.e2e.test_outage import settle, submit
from tests.harness import LaunchedServer, free_port, mock_config
from tests.private_redis import PrivateRedis
from twinkle.futures import FutureRecord

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
FLAPS = 10


@pytest.fixture
def flapping(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[LaunchedServer, PrivateRedis]]:
    broker = PrivateRedis(tmp_path / "redis", appendonly=True)
    broker.start()
    config = mock_config(tiny_model_dir, tmp_path / "checkpoints", port=free_port(), db=0)
    config["broker"]["url"] = broker.url
    server = LaunchedServer(config, tmp_path / "server.yaml", tmp_path / "server.log")
    server.start()
    yield server, broker
    server.stop()
    broker.kill()


def train(c: httpx.Client, model: str, stop: threading.Event, submitted: list[str]) -> None:
    """One op after another, as a training loop does, riding out the 503s while the broker is away. Each op
    carries its seq_id, as the Tinker SDK's do: a submit whose answer was lost with the broker (a 503 for an op
    Redis had stored) is retried under the same seq_id and runs once."""
    step = 0
    while not stop.is_set():
        if step % 2:
            body = {"model_id": model, "seq_id": step + 1, "adam_params": {"learning_rate": 0.01}}
            submitted.append(submit(c, "/optim_step", body))
        else:
            body = fb_body(model, [datum([3, 4, 5, 6, 7 + step % 5])], seq_id=step + 1)
            submitted.append(submit(c, "/forward_backward", body))
        settle(c, submitted[-1])
        step += 1


def test_a_pool_worker_rides_out_ten_broker_restarts_without_exiting_losing_its_adapter_or_running_an_op_twice(
        flapping: tuple[LaunchedServer, PrivateRedis]) -> None:
    server, broker = flapping
    pace = random.Random(23)
    with server.client("tml-flap") as c:
        model = new_model(c)
        worker = server.worker_pid()
        stop, submitted = threading.Event(), []
        trainer = threading.Thread(target=train, args=(c, model, stop, submitted), daemon=True)
        trainer.start()
        for _ in range(FLAPS):
            time.sleep(pace.uniform(1, 3))
            broker.outage(pace.uniform(0.2, 1.0))
        time.sleep(3)  # ops after the last restart
        stop.set()
        trainer.join(timeout=120)
        assert not trainer.is_alive()
        outcomes = [settle(c, rid) for rid in submitted]
        failed = [(rid, body, server.redis.hgetall(server.keys.future(rid)),
                   [line for line in server.log().splitlines() if rid in line])
                  for rid, body in zip(submitted, outcomes, strict=True) if "error" in body]
        assert not failed, failed  # nothing lost (appendonly) and no adapter_state_lost
        assert len(outcomes) > FLAPS  # training went on between the restarts
        after = settle(c, submit(c, "/forward_backward", fb_body(model, [datum([1, 2, 3])])))
        assert "error" not in after, after  # the adapter is still there
    assert server.worker_pid() == worker and "exited with code" not in server.log()
    executed = int(server.redis.hget(server.keys.model(model), "ops_executed") or 0)
    assert executed == len(submitted) + 2  # create_model, each op once, the last forward_backward
    indexes = [FutureRecord.from_hash(server.redis.hgetall(server.keys.future(rid))).exec_index for rid in submitted]
    assert indexes == sorted(indexes) and len(set(indexes)) == len(indexes)
