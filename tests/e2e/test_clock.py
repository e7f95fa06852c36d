"""Clock cycles end to end: several Tinker SDK clients train at once on one transformers pool whose ops run
in fused multi-tenant passes, and each gets exactly what it gets training alone on the same server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.test_foundation import assert_pipelined_ops_keep_each_adapters_order, fb_body, new_model, wait
from tests.e2e.test_foundation import datum as foundation_datum
from tests.e2e.test_recovery import private_server, stop
from tests.harness import LaunchedServer
from twinkle.keys import Keys

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CLIENTS = [  # rank, LoRA targets and loss differ per client
    {"rank": 4, "seed": 1, "train_mlp": False, "train_unembed": False, "loss": "cross_entropy"},
    {"rank": 8, "seed": 2, "loss": "importance_sampling"},
    {"rank": 2, "seed": 3, "train_attn": False, "loss": "cross_entropy"},
    {"rank": 16, "seed": 4, "train_unembed": False, "loss": "importance_sampling"},
]
STEPS = 3


@pytest.fixture(scope="module")
def clock_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    # A wide window so that the clients' ops, sent at once from four threads, reliably share passes.
    server, broker = private_server(tmp_path_factory.mktemp("clock"), tiny_model_dir, backend="transformers",
                                    clock={"enabled": True, "window_ms": 50, "max_ops": 8})
    server.env["OMP_NUM_THREADS"] = "1"
    try:
        server.start()
        yield server
    finally:
        stop(server, broker)


def data(client: int, loss: str) -> list[types.Datum]:
    rows = []
    for row in range(2):
        length = 6 + 3 * client + row
        tokens = [(17 * client + 5 * row + 3 * i) % 200 + 20 for i in range(length + 1)]
        inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
        if loss == "cross_entropy":
            inputs["weights"] = [1.0] * length
        else:
            inputs["logprobs"] = [-1.5 - 0.01 * i for i in range(length)]
            inputs["advantages"] = [(-1.0) ** i * 0.5 for i in range(length)]
        rows.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return rows


def run_client(service: tinker.ServiceClient, index: int, start: threading.Barrier | None) -> dict[str, Any]:
    spec = dict(CLIENTS[index])
    loss = spec.pop("loss")
    tc = service.create_lora_training_client(base_model="tiny-qwen", **spec).result()
    batch = data(index, loss)
    losses = []
    for _ in range(STEPS):
        if start is not None:
            start.wait()  # line the clients up so their ops reach the pool together
        fb = tc.forward_backward(batch, loss)
        opt = tc.optim_step(types.AdamParams(learning_rate=0.02))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    final = tc.forward(batch, "cross_entropy" if loss == "cross_entropy" else loss).result()
    return {"losses": losses, "logprobs": [out["logprobs"].tolist() for out in final.loss_fn_outputs]}


def fused_ops(server: LaunchedServer) -> int:
    """Ops the pool ran inside fused passes so far, from its heartbeat (written every 2 s)."""
    time.sleep(2.5)
    beat = server.redis.get(Keys().pool_heartbeat("model.models-tiny.0"))
    return int(json.loads(beat or "{}").get("fused_ops", 0))


def test_concurrent_clients_get_their_solo_results_from_fused_cycles(clock_server: LaunchedServer) -> None:
    service = tinker.ServiceClient(base_url=clock_server.base_url, api_key="tml-clock")
    solo = [run_client(service, index, None) for index in range(len(CLIENTS))]  # one client at a time

    start = threading.Barrier(len(CLIENTS))
    together: list[dict[str, Any]] = [{} for _ in CLIENTS]
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            together[index] = run_client(service, index, start)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(CLIENTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    # float32, the same sums in another order (padding, batched LoRA matmuls): see tests/.../test_fused_batch.py
    for alone, fused in zip(solo, together, strict=True):
        np.testing.assert_allclose(fused["losses"], alone["losses"], rtol=1e-4, atol=1e-5)
        for want, got in zip(alone["logprobs"], fused["logprobs"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert fused_ops(clock_server) >= 2, "no two ops ever shared a pass"


def test_pipelined_ops_of_four_adapters_keep_each_adapters_order_through_cycles(
        clock_server: LaunchedServer) -> None:
    assert_pipelined_ops_keep_each_adapters_order(clock_server, "tml-clock-order", rounds=12, optim_every=3)


def test_a_worker_killed_mid_cycle_fails_every_op_of_the_cycle_on_its_own(clock_server: LaunchedServer) -> None:
    with clock_server.client("tml-clock-crash") as c:
        saved, unsaved = new_model(c), new_model(c)
        wait(c, c.post("/save_weights", json={"model_id": saved, "path": "before-crash"}).json()["request_id"])
        big = [foundation_datum([(7 * i + row) % 400 + 3 for i in range(1500)]) for row in range(12)]
        rids = {m: c.post("/forward_backward", json=fb_body(m, big)).json()["request_id"] for m in (saved, unsaved)}
        deadline = time.time() + 60
        while clock_server.redis.hget(clock_server.keys.future(rids[saved]), "status") != b"running":
            assert time.time() < deadline, "the op never started"
            time.sleep(0.005)
        os.kill(clock_server.worker_pid(), signal.SIGKILL)
        outcomes = {m: wait(c, rid) for m, rid in rids.items()}
        assert all(outcome["category"] == "server" for outcome in outcomes.values()), outcomes
        assert f"tinker://{saved}/weights/before-crash" in outcomes[saved]["error"]
        assert "No checkpoint" in outcomes[unsaved]["error"]
        other = new_model(c)  # the restarted worker serves again, clock and all
        assert "metrics" in wait(c, c.post("/forward_backward", json=fb_body(other, [foundation_datum([1, 2, 3])]))
                                 .json()["request_id"])
