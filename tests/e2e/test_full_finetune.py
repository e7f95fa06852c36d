"""Full-parameter runs beside LoRA runs on one transformers pool: the full run learns and holds the pool while LoRA
tenants wait with their polls saying why, its checkpoint is a whole model that downloads, resumes and samples, and
when it ends (unloaded, lease expired, ended by the operator) the LoRA adapters find the base model as it was."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.harness import LaunchedServer, launch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
LEASE_SECONDS = 6
BATCH = [datum([5 + (i * 3 + k) % 40 for i in range(12)]) for k in range(3)]
QUEUE = "model.models-tiny.0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    launched = launch(tmp_path_factory.mktemp("full-server"), tiny_model_dir, db=9, backend="transformers",
                      sampler=True, env={"OMP_NUM_THREADS": "1", "TWINKLE_LONG_POLL_SECONDS": "1"},
                      model_args={"full_finetune": {"enabled": True, "lease_seconds": LEASE_SECONDS}})
    yield launched
    launched.stop()


def session(c: httpx.Client) -> str:
    return str(c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"])


def new_full_run(c: httpx.Client, sid: str | None = None) -> str:
    r = c.post("/create_model", json={"session_id": sid or session(c), "base_model": "tiny-qwen",
                                      "training_mode": "full", "lora_config": {"seed": 3}})
    assert r.status_code == 200, r.text
    assert wait(c, r.json()["request_id"])["model_id"] == r.json()["model_id"]
    return str(r.json()["model_id"])


def submit(c: httpx.Client, path: str, body: dict[str, Any]) -> str:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["request_id"])


def step(c: httpx.Client, model: str, lr: float = 0.02) -> float:
    fb = submit(c, "/forward_backward", fb_body(model, BATCH))
    opt = submit(c, "/optim_step", {"model_id": model, "adam_params": {"learning_rate": lr}})
    loss = float(wait(c, fb)["metrics"]["loss:sum"])
    assert "error" not in wait(c, opt)
    return loss


def logprobs(c: httpx.Client, model: str) -> list[float]:
    out = wait(c, submit(c, "/forward", {"model_id": model, "forward_input": {"data": BATCH[:1],
                                                                             "loss_fn": "cross_entropy"}}))
    assert "error" not in out, out
    return list(out["loss_fn_outputs"][0]["logprobs"]["data"])


def poll(c: httpx.Client, request_id: str) -> dict[str, Any]:
    r = c.post("/retrieve_future", json={"request_id": request_id})
    assert r.status_code == 200, r.text
    return dict(r.json())


def reservations(server: LaunchedServer, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "twinkle.server", "reservations", "-c", str(server.config_path),
                           *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_full_run_learns_holds_the_pool_and_the_lora_tenant_finds_its_adapter_as_it_was(
        server: LaunchedServer) -> None:
    with server.client("tml-lora-tenant") as lora, server.client("tml-full-tenant") as full:
        adapter = new_model(lora)
        step(lora, adapter)
        before = logprobs(lora, adapter)

        run = new_full_run(full)
        info = full.post("/get_info", json={"model_id": run}).json()
        assert info["is_lora"] is False and info["training_mode"] == "full"
        waiting = submit(lora, "/forward", {"model_id": adapter, "forward_input": {"data": BATCH[:1],
                                                                                     "loss_fn": "cross_entropy"}})
        losses = [step(full, run) for _ in range(4)]
        assert losses[-1] < losses[0], losses  # all the base weights learn

        answer = poll(lora, waiting)  # parked behind the full run, and its poll says so
        assert answer["type"] == "try_again" and answer["queue_state"] == "paused_capacity", answer
        assert "reserved by a full-parameter run" in answer["queue_state_reason"], answer
        assert f"held by {run}" in reservations(server)

        saved = wait(full, submit(full, "/save_weights", {"model_id": run, "path": "step4"}))
        path = saved["path"]
        archive = full.get(f"/training_runs/{run}/checkpoints/weights/step4/archive", follow_redirects=True)
        assert archive.status_code == 200
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            names = tar.getnames()
        assert any(name.endswith("config.json") for name in names)
        assert any(name.endswith(".safetensors") for name in names)
        assert not any("adapter_model" in name for name in names)

        wait(full, submit(full, "/unload_model", {"model_id": run}))
        assert logprobs(lora, adapter) == before  # the base weights came back bit for bit
        assert "error" not in wait(lora, waiting)
        assert "free" in reservations(server)

        other = new_model(full)  # a LoRA run of the same key never loads the full checkpoint
        refused = full.post("/load_weights", json={"model_id": other, "path": path, "seq_id": 90})
        assert refused.status_code == 400 and "full checkpoint" in refused.text, refused.text


def test_a_full_checkpoint_resumes_exactly_in_a_new_full_run(server: LaunchedServer) -> None:
    with server.client("tml-full-resume") as c:
        run = new_full_run(c)
        step(c, run)
        wait(c, submit(c, "/save_weights", {"model_id": run, "path": "one"}))
        path = f"tinker://{run}/weights/one"
        continued = [step(c, run) for _ in range(2)]
        wait(c, submit(c, "/unload_model", {"model_id": run}))

        r = c.post("/load_weights", json={"session_id": session(c), "path": path, "optimizer": True})
        assert r.status_code == 200, r.text
        resumed_run = r.json()["model_id"]
        assert "error" not in wait(c, r.json()["request_id"])
        resumed = [step(c, resumed_run) for _ in range(2)]
        assert resumed == continued  # weights, Adam moments and step count restored bit for bit
        wait(c, submit(c, "/unload_model", {"model_id": resumed_run}))


def test_a_full_run_whose_client_went_silent_frees_the_pool_when_its_lease_runs_out(server: LaunchedServer) -> None:
    with server.client("tml-lora-patient") as lora, server.client("tml-full-silent") as full:
        adapter = new_model(lora)
        run = new_full_run(full)
        began = time.time()
        out = wait(lora, submit(lora, "/forward_backward", fb_body(adapter, BATCH[:1])))
        assert "error" not in out
        assert LEASE_SECONDS - 1 < time.time() - began < LEASE_SECONDS + 15
        gone = full.post("/forward_backward", json=fb_body(run, BATCH[:1]))
        assert gone.status_code == 404 and gone.json()["code"] == "adapter_gone", gone.text
        assert "exclusive hold of pool model.models-tiny.0 ended: no op and no session heartbeat" in gone.text


def test_an_operator_ends_a_full_runs_hold_and_the_waiting_ops_run(server: LaunchedServer) -> None:
    with server.client("tml-lora-op") as lora, server.client("tml-full-op") as full:
        adapter = new_model(lora)
        sid = session(full)
        run = new_full_run(full, sid)
        waiting = submit(lora, "/forward_backward", fb_body(adapter, BATCH[:1]))
        for _ in range(3):  # the session's heartbeat keeps the lease past its length
            time.sleep(LEASE_SECONDS / 2)
            assert full.post("/session_heartbeat", json={"session_id": sid}).status_code == 200
        assert poll(lora, waiting)["type"] == "try_again"
        assert "ended the hold of" in reservations(server, "--end", QUEUE)
        assert "error" not in wait(lora, waiting)
        gone = full.post("/optim_step", json={"model_id": run, "adam_params": {"learning_rate": 0.01}})
        assert gone.status_code == 404 and "an operator ended it" in gone.text, gone.text


def test_asking_for_a_mode_the_pool_does_not_offer_or_two_modes_at_once_is_refused(
        server: LaunchedServer, mock_server: LaunchedServer) -> None:
    with mock_server.client() as c:
        r = c.post("/create_model", json={"session_id": session(c), "base_model": "tiny-qwen",
                                          "training_mode": "full"})
        assert r.status_code == 400 and "not open to full-parameter training" in r.text, r.text
    with server.client() as c:
        r = c.post("/create_model", json={"session_id": session(c), "base_model": "tiny-qwen",
                                          "training_mode": "lora", "user_metadata": {"training_mode": "full"}})
        assert r.status_code == 400 and "disagree" in r.text, r.text


def test_the_tinker_sdk_asks_for_a_full_run_in_user_metadata_and_samples_its_weights_here_and_over_openai(
        server: LaunchedServer) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-full-sdk")
    training = service.create_lora_training_client(base_model="tiny-qwen",
                                                   user_metadata={"training_mode": "full"}).result()
    assert training.get_info().is_lora is False
    tokens = [7, 8, 9, 10] * 5
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(8):  # the pattern 7 8 9 10 becomes what the whole model predicts
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.01)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    out = sampler.sample(types.ModelInput.from_ints([7, 8, 9, 10, 7, 8]), 1, params).result()
    assert out.sequences[0].tokens[:4] == [9, 10, 7, 8], out.sequences[0].tokens

    path = training.save_weights_for_sampler("full-openai").result().path
    training_id = training.model_id
    httpx.post(f"{server.api}/unload_model", json={"model_id": training_id}, headers={"X-API-Key": "tml-full-sdk"},
               timeout=60).raise_for_status()
    reply = openai.OpenAI(base_url=server.base_url + "/v1", api_key="tml-full-sdk", max_retries=0).completions.create(
        model=path, prompt=[7, 8, 9, 10, 7, 8], max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert reply.choices[0].text  # served by the sampler pool from the whole-model checkpoint


def test_the_twinkle_client_trains_all_the_weights_when_asked_and_refuses_a_lora_config_with_it(
        server: LaunchedServer, tiny_model_dir: Path) -> None:
    import numpy as np

    from twinkle_client import InvalidArgument, init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel

    with init_twinkle_client(server.base_url, "tml-full-client"):
        model = MultiLoraTransformersModel(str(tiny_model_dir))
        with pytest.raises(InvalidArgument, match="takes no LoRA config"):
            model.add_adapter_to_model("full", {"r": 4}, training_mode="full")
        model.add_adapter_to_model("full", training_mode="full")
        model.set_loss("CrossEntropyLoss")
        model.set_optimizer("Adam", lr=1e-3)
        batch = [{"input_ids": np.arange(5, 25), "labels": np.arange(5, 25)}]
        losses = []
        for _ in range(4):
            losses.append(model.forward_backward(inputs=batch).loss)
            model.clip_grad_and_step()
        assert losses[-1] < losses[0], losses
        model.save("full-client")
        run = model.training_run_id
        with server.client("tml-full-client") as c:
            assert c.post("/get_info", json={"model_id": run}).json()["training_mode"] == "full"
        model.unload()
    with server.client("tml-full-client") as c:
        archive = c.get(f"/training_runs/{run}/checkpoints/weights/full-client/archive", follow_redirects=True)
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            assert any(name.endswith("twinkle_full.json") for name in tar.getnames())
