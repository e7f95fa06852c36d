"""A model app with two pool replicas: adapters spread over them and stay where they were placed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.harness import LaunchedServer, launch
from twinkle.futures import FutureRecord
from twinkle.records import ModelRecord

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server = launch(tmp_path_factory.mktemp("replicas"), tiny_model_dir, db=8, replicas=2)
    yield server
    server.stop()


def test_new_adapters_go_to_the_replica_with_most_free_slots_and_stay_there(two_replicas: LaunchedServer) -> None:
    with two_replicas.client("tml-replicas") as c:
        models = [new_model(c) for _ in range(6)]
        queues = {m: ModelRecord.from_hash(two_replicas.redis.hgetall(two_replicas.keys.model(m))).queue
                  for m in models}
        assert Counter(queues.values()) == {"model.models-tiny.0": 3, "model.models-tiny.1": 3}
        for m in models:
            rid = c.post("/forward_backward", json=fb_body(m, [datum([1, 2, 3, 4])])).json()["request_id"]
            assert "metrics" in wait(c, rid)
            record = FutureRecord.from_hash(two_replicas.redis.hgetall(two_replicas.keys.future(rid)))
            assert record.queue == queues[m]
