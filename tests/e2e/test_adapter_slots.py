"""LoRA slots as a cache, through the real Tinker SDK on the transformers backend: a user who reruns a script
more often than there are slots never meets a slot error, and closing a ServiceClient frees its slots."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.harness import LaunchedServer, launch
from twinkle.auth import tenant_id

pytestmark = pytest.mark.e2e
BASE = "tiny-qwen"
KEY = "tml-slots-e2e"
SLOTS = 2
QUEUE = "model.models-tiny.0"
BATCH = [types.Datum(model_input=types.ModelInput.from_ints([5 + (i * 3 + k) % 40 for i in range(12)]),
                     loss_fn_inputs={"target_tokens": [5 + (i * 3 + k) % 40 for i in range(1, 13)],
                                     "weights": [1.0] * 12}) for k in range(2)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server = launch(tmp_path_factory.mktemp("slots"), tiny_model_dir, db=13, backend="transformers",
                    max_loras=SLOTS, env={"OMP_NUM_THREADS": "1"})
    yield server
    server.stop()


def run_script(server: LaunchedServer) -> tuple[tinker.ServiceClient, tinker.TrainingClient, float]:
    """What a user's training script does, minus closing its ServiceClient (scripts often forget)."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    training = service.create_lora_training_client(base_model=BASE, rank=2, seed=1).result()
    loss = training.forward_backward(BATCH, "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return service, training, loss


def resident(server: LaunchedServer) -> set[str]:
    return {m.decode() for m in server.redis.smembers(server.keys.pool_adapters(QUEUE))}


def test_rerunning_a_script_more_times_than_there_are_slots_never_hits_the_slot_wall(server: LaunchedServer) -> None:
    runs = [run_script(server) for _ in range(SLOTS + 2)]  # every run left its adapter behind
    assert len({run[2] for run in runs}) == 1  # same seed, same data: the same first loss every time
    assert len(resident(server)) == SLOTS
    first = runs[0][1]
    assert first.model_id not in resident(server)  # the oldest run was paged out, not refused
    # ... and the first run, paged out meanwhile, trains on: paged back in with its optimizer state
    second_loss = first.forward_backward(BATCH, "cross_entropy").result().metrics["loss:sum"]
    assert second_loss < runs[0][2]
    assert first.model_id in resident(server)
    stats = {k.decode(): float(v) for k, v in server.redis.hgetall(server.keys.pool_paging(QUEUE)).items()}
    assert stats["page_outs"] >= 3 and stats["page_ins"] >= 1 and stats["bytes_paged_in"] > 0
    for service, _, _ in runs:
        service.close("success").result()


def test_closing_a_service_client_frees_its_slots_and_its_model_count_at_once(server: LaunchedServer) -> None:
    service, training, _ = run_script(server)
    model_id = training.model_id
    assert model_id in resident(server)
    service.close("success").result()
    record = server.redis.hgetall(server.keys.model(model_id))
    assert record[b"status"] == b"unloaded" and b"session finished" in record[b"unload_reason"]
    assert not server.redis.sismember(server.keys.owner_models(tenant_id(KEY)), model_id)
    deadline = time.time() + 10  # the pool drops it on its next sweep (1 s) or the queued unload op
    while model_id in resident(server) and time.time() < deadline:
        time.sleep(0.1)
    assert model_id not in resident(server)
    info = json.loads(server.redis.get(server.keys.pool_heartbeat(QUEUE)) or b"{}")
    assert info  # the pool is alive and well after it
