"""A mock pool that refuses other runs' ops while a full-parameter run holds it, and loses that run with its
worker: the refusal names the end of the hold, the lost run's ops name its last checkpoint, and the restarted
pool is free for everyone again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.e2e.test_full_finetune import new_full_run, step, submit
from tests.harness import LaunchedServer, free_port, launch, mock_config
from twinkle.auth import tenant_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    launched = launch(tmp_path_factory.mktemp("full-refuse"), tiny_model_dir, db=8,
                      env={"TWINKLE_LONG_POLL_SECONDS": "1"},
                      model_args={"full_finetune": {"enabled": True, "while_reserved": "refuse"}})
    yield launched
    launched.stop()


def test_a_refusing_pool_answers_other_runs_423_until_the_full_run_ends(server: LaunchedServer) -> None:
    with server.client("tml-refused") as lora, server.client("tml-holder") as full:
        adapter = new_model(lora)
        run = new_full_run(full)
        refused = lora.post("/forward_backward", json=fb_body(adapter, [datum([3, 4, 5, 6])]))
        assert refused.status_code == 423 and refused.json()["code"] == "pool_reserved", refused.text
        assert "reserved by a full-parameter run until" in refused.json()["error"]
        assert refused.json()["details"]["holder"] == run
        models_before = server.redis.scard(server.keys.owner_models(tenant_id("tml-holder")))
        second = full.post("/create_model", json={"session_id": full.post("/create_session", json={
            "tags": [], "sdk_version": "t"}).json()["session_id"], "base_model": "tiny-qwen", "training_mode": "full"})
        assert second.status_code == 423  # one full run at a time
        assert server.redis.scard(server.keys.owner_models(tenant_id("tml-holder"))) == models_before  # not counted
        losses = [step(full, run, lr=0.1) for _ in range(3)]
        assert losses[-1] < losses[0]
        wait(full, submit(full, "/unload_model", {"model_id": run}))
        assert "error" not in wait(lora, submit(lora, "/forward_backward", fb_body(adapter, [datum([3, 4, 5, 6])])))


def test_a_full_run_lost_with_its_worker_names_its_last_checkpoint_and_frees_the_pool(
        server: LaunchedServer) -> None:
    with server.client("tml-crash-lora") as lora, server.client("tml-crash-full") as full:
        adapter = new_model(lora)
        run = new_full_run(full)
        step(full, run, lr=0.1)
        saved = wait(full, submit(full, "/save_weights", {"model_id": run, "path": "before-crash"}))["path"]
        worker = server.worker_pid()
        os.kill(worker, signal.SIGKILL)
        lost = wait(full, submit(full, "/forward_backward", fb_body(run, [datum([3, 4, 5, 6])])))
        assert lost["code"] == "adapter_state_lost" and saved in lost["error"], lost
        deadline = time.time() + 60
        while True:  # refused until the restarted worker clears the hold its predecessor left
            r = lora.post("/forward_backward", json=fb_body(adapter, [datum([3, 4, 5, 6])]))
            if r.status_code == 200:
                break
            assert r.status_code == 423 and time.time() < deadline, r.text
            time.sleep(0.5)
        assert server.worker_pid() != worker
        assert wait(lora, r.json()["request_id"])["code"] == "adapter_state_lost"  # its adapter died too
        resumed = full.post("/load_weights", json={"session_id": full.post("/create_session", json={
            "tags": [], "sdk_version": "t"}).json()["session_id"], "path": saved, "optimizer": True})
        assert resumed.status_code == 200, resumed.text
        assert "error" not in wait(full, resumed.json()["request_id"])  # a full run again, from the checkpoint
        wait(full, submit(full, "/unload_model", {"model_id": resumed.json()["model_id"]}))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, ray_address: str
          ) -> Iterator[LaunchedServer]:
    """A mock pool of two data-parallel ranks on the session's Ray instance, open to full runs."""
    tmp = tmp_path_factory.mktemp("full-ranks")
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=7,
                         model_args={"full_finetune": {"enabled": True},
                                     "device_group": {"name": "model", "ranks": 2, "device_type": "cpu"},
                                     "device_mesh": {"dp_size": 2}})
    config["ray"] = {"address": ray_address}
    launched = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log")
    launched.start(timeout=240)
    yield launched
    launched.stop()


def test_a_full_run_on_two_data_parallel_ranks_learns_like_one_rank_and_resumes_exactly(
        ranks: LaunchedServer, server: LaunchedServer) -> None:
    data = [datum([5 + (i * 7) % 50 for i in range(k, k + 16)]) for k in range(3)]  # shards of 2 and 1

    def trained(on: LaunchedServer, key: str) -> tuple[list[float], str]:
        with on.client(key) as c:
            run = new_full_run(c)
            losses = []
            for _ in range(3):
                fb = submit(c, "/forward_backward", fb_body(run, data))
                opt = submit(c, "/optim_step", {"model_id": run, "adam_params": {"learning_rate": 0.1}})
                losses.append(float(wait(c, fb)["metrics"]["loss:sum"]))
                assert "error" not in wait(c, opt)
            path = wait(c, submit(c, "/save_weights", {"model_id": run, "path": "dp"}))["path"]
            wait(c, submit(c, "/unload_model", {"model_id": run}))
            return losses, path

    two, path = trained(ranks, "tml-full-dp")
    one, _ = trained(server, "tml-full-single")
    assert two == pytest.approx(one, rel=1e-5)  # the ranks' gradients summed: the same steps as one replica
    with ranks.client("tml-full-dp") as c:
        resumed = c.post("/load_weights", json={"session_id": c.post("/create_session", json={
            "tags": [], "sdk_version": "t"}).json()["session_id"], "path": path, "optimizer": True})
        assert resumed.status_code == 200 and "error" not in wait(c, resumed.json()["request_id"])
