"""Merged exports through a launched server (issue 21): a checkpoint trained with the Tinker SDK (LoRA on attention,
MLP and the output head) is merged once on the transformers pool, its check shows in list_checkpoints and the
console, the client's download helper writes a directory plain transformers loads and that gives the server's
logprobs, the archive streams the same files, and deleting the checkpoint takes the export with it. The mock
backend refuses by name."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tinker

from tests.e2e import test_weight_export as export_test
from tests.e2e.test_weight_export import datum, status_of
from tests.harness import LaunchedServer
from twinkle.auth import tenant_id
from twinkle_client import TwinkleClient

pytestmark = pytest.mark.e2e
BASE = "tiny-qwen"
KEY = "tml-merged-e2e"
TOKENS = [7 + (i * 5) % 90 for i in range(20)]


def trained_client(server: LaunchedServer, steps: int = 2) -> tinker.TrainingClient:
    return export_test.trained_client(server, steps, key=KEY, tokens=TOKENS)


@pytest.mark.slow
def test_a_checkpoint_merged_on_the_server_downloads_as_a_model_plain_transformers_loads(
        transformers_server: LaunchedServer, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tc = trained_client(transformers_server)
    server_logprobs = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    path = tc.save_state("merge-me").result().path
    run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    external = tc.save_weights_external("peft").result().path  # the PEFT download is checked when saved

    with TwinkleClient(transformers_server.base_url, KEY) as client:
        both = [client.submit_export_merged(path) for _ in range(2)]  # asked twice at once: merged once
        assert both[0].request_id == both[1].request_id
        first = both[0].result(timeout=240)
        assert client.export_merged(path) == first  # and asked again once done: the same answer
        assert first.status == "verified" and first.max_abs_diff is not None and first.max_abs_diff < 1e-3
        assert first.export["merged"]["status"] == first.export["adapter"]["status"] == "verified"
        listing = {c.tinker_path: c for c in client.list_checkpoints(run)}
        assert listing[path].export == first.export  # list_checkpoints shows the check
        peft = listing[external].export
        assert peft is not None and peft["adapter"]["status"] == "verified" and peft["max_abs_diff"] < 1e-3
        directory = client.download_merged(path, tmp_path / "model")
    assert sorted(p.name for p in directory.iterdir()) == sorted(first.files)
    cli = subprocess.run([sys.executable, "-m", "twinkle.server", "export-merged", path, str(tmp_path / "cli"),
                          "--base-url", transformers_server.base_url, "--api-key", KEY],
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0 and "verified" in cli.stdout, cli.stderr
    assert all((tmp_path / "cli" / name).read_bytes() == (directory / name).read_bytes() for name in first.files)

    model = AutoModelForCausalLM.from_pretrained(directory).eval()  # no PEFT, no Twinkle
    assert AutoTokenizer.from_pretrained(directory).decode(TOKENS)
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    local = torch.log_softmax(logits, dim=-1)[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].numpy()
    np.testing.assert_allclose(local, server_logprobs, atol=1e-4)

    with transformers_server.client(KEY) as http:
        archive = http.get(f"/training_runs/{run}/checkpoints/{checkpoint_id}/merged_archive")
        assert archive.status_code == 302
        overview = http.get(transformers_server.base_url + "/console/fragments/overview").text
        assert "merged model" in overview and "max |Δ|" in overview
        urls = http.get(f"/training_runs/{run}/checkpoints/{checkpoint_id}/merged_urls").json()["urls"]
    with urllib.request.urlopen(archive.headers["Location"], timeout=30) as response:
        data = response.read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == sorted(f"merge-me-merged/{name}" for name in first.files)
        member = tar.extractfile("merge-me-merged/config.json")
        assert member is not None and member.read() == (directory / "config.json").read_bytes()

    tinker.RestClient(base_url=transformers_server.base_url, api_key=KEY).delete_checkpoint_from_tinker_path(
        path).result()
    assert status_of(urls["config.json"]) == 404  # the export went with its checkpoint
    on_disk = Path(transformers_server.config["storage"]["checkpoint_dir"]) / tenant_id(KEY) / run / "merged"
    assert not any(on_disk.rglob("config.json"))


def test_a_server_whose_backend_cannot_merge_says_so(mock_server: LaunchedServer) -> None:
    tc = trained_client(mock_server, steps=1)
    path = tc.save_state("no-merge").result().path
    with mock_server.client(KEY) as http:
        answer = http.post("/export_merged", json={"path": path})
        assert answer.status_code == 400 and "mock backend" in answer.json()["error"]
        run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
        missing = http.get(f"/training_runs/{run}/checkpoints/{checkpoint_id}/merged_urls")
        assert missing.status_code == 404 and "export_merged" in missing.json()["error"]
