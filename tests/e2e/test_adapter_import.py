"""Importing a PEFT adapter into a launched transformers server: an adapter made with plain PEFT on the tiny model
becomes checkpoints of the uploading key, computes what PEFT computes, trains through the real Tinker SDK and the
Twinkle client, samples (the `/v1` endpoint included); broken, foreign, pickled and oversized uploads are refused
with messages that say what is wrong, and another key can neither see nor load the import."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import save_file
from tinker import types
from transformers import AutoModelForCausalLM

from tests.harness import LaunchedServer
from twinkle.auth import tenant_id
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import Sampler

pytestmark = pytest.mark.e2e
OWNER, INTRUDER, CLIENT_USER = "tml-import-owner", "tml-import-intruder", "tml-import-client"
SEQUENCE = [10, 11, 12, 13] * 5
PROMPT = [10, 11, 12]


@pytest.fixture(scope="module")
def server(transformers_server: LaunchedServer) -> LaunchedServer:
    return transformers_server


@pytest.fixture(scope="module")
def peft_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[PeftModel, Path]:
    """A LoRA adapter made with plain PEFT on the tiny model (random A and B, so it changes the outputs)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM",
                        init_lora_weights=False)
    peft = get_peft_model(base, config)
    directory = tmp_path_factory.mktemp("peft") / "adapter"
    peft.save_pretrained(directory)  # adapter_config.json, adapter_model.safetensors, README.md
    peft.eval()
    return peft, directory


def tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def directory_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def upload(server: LaunchedServer, key: str, data: bytes, **params: Any) -> httpx.Response:
    return httpx.post(server.api + "/import_adapter", params=params, content=data, timeout=120,
                      headers={"X-API-Key": key, "Content-Type": "application/x-tar"})


def peft_logprobs(peft: PeftModel, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def peft_greedy(peft: PeftModel, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(peft(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


@pytest.fixture(scope="module")
def imported(server: LaunchedServer, peft_model: tuple[PeftModel, Path]) -> dict[str, Any]:
    r = upload(server, OWNER, tar_of(directory_files(peft_model[1])), name="from-peft")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_peft_adapter_imports_as_a_training_and_a_sampler_checkpoint_of_its_key(
        server: LaunchedServer, imported: dict[str, Any]) -> None:
    run = imported["training_run_id"]
    assert imported["path"] == f"tinker://{run}/weights/from-peft"
    assert imported["sampler_path"] == f"tinker://{run}/sampler_weights/from-peft"
    assert imported["base_model"] == "tiny-qwen" and imported["lora_rank"] == 4
    assert imported["lora_config"]["target_modules"] == ["q_proj", "up_proj", "v_proj"]
    assert imported["ignored_files"] == ["README.md"]
    rest = tinker.RestClient(base_url=server.base_url, api_key=OWNER)
    checkpoints = rest.list_checkpoints(run).result().checkpoints
    assert {c.checkpoint_id for c in checkpoints} == {"weights/from-peft", "sampler_weights/from-peft"}
    assert run in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
    info = rest.get_weights_info_by_tinker_path(imported["path"]).result()
    assert (info.base_model, info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (
        "tiny-qwen", 4, True, True, False)
    stored = Path(server.config["storage"]["checkpoint_dir"]) / tenant_id(OWNER) / run
    assert sorted(p.name for p in (stored / "weights" / "from-peft").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "checkpoint_metadata.json"]


def test_the_tinker_sdk_trains_on_the_imported_adapter_from_peft_s_own_outputs(
        server: LaunchedServer, imported: dict[str, Any], peft_model: tuple[PeftModel, Path]) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=OWNER)
    tc = service.create_training_client_from_state(imported["path"]).result()
    assert tc.get_info().lora_rank == 4
    out = tc.forward([datum(SEQUENCE)], "cross_entropy").result()
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), peft_logprobs(peft_model[0], SEQUENCE),
                               rtol=1e-4, atol=1e-4)  # the server computes with exactly the uploaded weights
    losses = []
    for _ in range(8):
        fb = tc.forward_backward([datum(SEQUENCE)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert all(later < earlier for earlier, later in pairwise(losses)), losses
    assert tc.save_state("after-import").result().path.endswith("/weights/after-import")
    with pytest.raises(tinker.RequestFailedError, match="no optimizer state"):  # an upload brings none
        service.create_training_client_from_state_with_optimizer(imported["path"]).result()


def test_the_imported_sampler_checkpoint_samples_what_peft_generates(
        server: LaunchedServer, imported: dict[str, Any], peft_model: tuple[PeftModel, Path]) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=OWNER)
    sampler = service.create_sampling_client(model_path=imported["sampler_path"]).result()
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    sampled = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0].tokens
    assert sampled == peft_greedy(peft_model[0], PROMPT, 6)


def test_the_openai_endpoint_serves_the_import_by_its_sampler_path(server: LaunchedServer,
                                                                    imported: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {OWNER}"}
    listed = httpx.get(server.base_url + "/v1/models", headers=headers, timeout=30).json()
    assert imported["sampler_path"] in {m["id"] for m in listed["data"]}
    r = httpx.post(server.base_url + "/v1/completions", headers=headers, timeout=120, json={
        "model": imported["sampler_path"], "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == imported["sampler_path"] and len(r.json()["choices"]) == 1


def test_another_key_can_neither_see_nor_load_the_import(server: LaunchedServer, imported: dict[str, Any]) -> None:
    run = imported["training_run_id"]
    with server.client(INTRUDER) as c:
        session = c.post("/create_session", json={}).json()["session_id"]
        attempts = [
            c.post("/load_weights", json={"session_id": session, "model_seq_id": 0, "path": imported["path"]}),
            c.post("/weights_info", json={"tinker_path": imported["path"]}),
            c.post("/create_sampling_session", json={"session_id": session, "model_path": imported["sampler_path"]}),
            c.post("/asample", json={"model_path": imported["sampler_path"],
                                     "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}}),
            c.get(f"/training_runs/{run}/checkpoints"),
            c.get(f"/training_runs/{run}"),
        ]
        for r in attempts:
            assert r.status_code == 404, (r.request.url, r.text)
        assert run not in c.get("/training_runs").text and run not in c.get("/checkpoints").text
    openai = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {INTRUDER}"},
                        json={"model": imported["sampler_path"], "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert openai.status_code == 404


def test_the_twinkle_client_imports_a_directory_trains_on_it_and_samples_it(
        server: LaunchedServer, peft_model: tuple[PeftModel, Path]) -> None:
    with TwinkleClient(server.base_url, CLIENT_USER) as client:
        imported = client.import_adapter(peft_model[1], name="via-client")
        assert imported.twinkle_path.startswith("twinkle://") and imported.twinkle_path.endswith("/weights/via-client")
        assert imported.ignored_files == []  # the client sends the two adapter files only
        model = MultiLoraTransformersModel("tiny-qwen", client=client)
        model.add_adapter_to_model("imported", imported.lora_config)
        model.resume_from_checkpoint(imported.twinkle_path, resume_only_model=True)
        model.set_optimizer("Adam", lr=2e-2)
        batch = [{"input_ids": SEQUENCE, "labels": SEQUENCE}]
        first = model.forward_only(batch)
        np.testing.assert_allclose(first.logprobs[0], peft_logprobs(peft_model[0], SEQUENCE), rtol=1e-4, atol=1e-4)
        losses = []
        for _ in range(6):
            losses.append(model.forward_backward(inputs=batch).loss)
            model.clip_grad_and_step()
        assert all(later < earlier for earlier, later in pairwise(losses)), losses
        sampled = Sampler("tiny-qwen", client=client).sample(
            PROMPT, sampling_params={"max_tokens": 6, "temperature": 0.0, "stop": []},
            adapter_path=imported.twinkle_sampler_path)
        assert sampled.sequences[0].tokens == peft_greedy(peft_model[0], PROMPT, 6)
        assert any(c.checkpoint_id == "weights/via-client" for c in client.list_checkpoints(imported.training_run_id))


def safetensors_bytes(tensors: dict[str, np.ndarray], tmp_path: Path) -> bytes:
    save_file(tensors, str(tmp_path / "w.safetensors"))
    return (tmp_path / "w.safetensors").read_bytes()


def refused_uploads(peft_dir: Path, tmp_path: Path) -> Iterator[tuple[str, bytes, str]]:
    files = directory_files(peft_dir)
    config = json.loads(files["adapter_config.json"])
    yield "corrupted", tar_of({**files, "adapter_model.safetensors": files["adapter_model.safetensors"][:-100]}), \
        "adapter_model.safetensors is not a valid safetensors file"
    rng = np.random.default_rng(0)
    foreign = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{part}.weight": rng.standard_normal(
        shape).astype(np.float32) for i in range(2) for part, shape in (("A", (4, 96)), ("B", (96, 4)))}
    foreign_config = {**config, "target_modules": ["q_proj"]}
    yield "foreign-shape", tar_of({"adapter_config.json": json.dumps(foreign_config).encode(),
                                   "adapter_model.safetensors": safetensors_bytes(foreign, tmp_path)}), \
        "must be [4, 64] and [64, 4]: the adapter was made for another base model"
    yield "wrong-base", tar_of({**files, "adapter_config.json": json.dumps(
        {**config, "base_model_name_or_path": "meta-llama/Llama-3.1-8B"}).encode()}), \
        "trained on 'meta-llama/Llama-3.1-8B' (base_model_name_or_path), which this server does not serve"
    state = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    pickled = io.BytesIO()
    torch.save(state, pickled)
    yield "pickle", tar_of({"adapter_config.json": files["adapter_config.json"],
                            "adapter_model.bin": pickled.getvalue()}), \
        "'adapter_model.bin' is a pickle"
    yield "pickle-renamed", tar_of({"adapter_config.json": files["adapter_config.json"],
                                    "adapter_model.safetensors": pickled.getvalue()}), \
        "adapter_model.safetensors is a PyTorch pickle"


def test_broken_foreign_pickled_and_misdirected_uploads_are_refused_and_leave_nothing(
        server: LaunchedServer, peft_model: tuple[PeftModel, Path], tmp_path: Path) -> None:
    key = "tml-import-refused"
    for case, data, message in refused_uploads(peft_model[1], tmp_path):
        r = upload(server, key, data)
        assert r.status_code == 400, (case, r.text)
        assert message in r.json()["error"], (case, r.json())
        assert "/tmp" not in r.text and "Traceback" not in r.text
    with server.client(key) as c:
        assert c.get("/training_runs").json()["training_runs"] == []
    tenant_dir = Path(server.config["storage"]["checkpoint_dir"]) / tenant_id(key)
    assert not tenant_dir.exists() or [p for p in tenant_dir.rglob("*") if p.is_file()] == []


def test_an_upload_over_the_limit_is_refused_with_413_before_it_is_read(server: LaunchedServer) -> None:
    def gigabytes() -> Iterator[bytes]:
        for _ in range(2048):
            yield b"\0" * (1 << 20)

    r = httpx.post(server.api + "/import_adapter", content=gigabytes(), timeout=60,
                   headers={"X-API-Key": "tml-import-big", "Content-Length": str(2 << 30)})
    assert r.status_code == 413
    assert "at most 1073741824 bytes" in r.json()["error"] and "max_adapter_upload_bytes" in r.json()["error"]
