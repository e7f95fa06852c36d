"""Weight export and download with the real Tinker SDK 0.38: save_weights_external, get_external_weights_urls,
copy_weights, the checkpoint archive, and what an unknown route answers (issue 14, item 2).

Downloads go over real HTTP with plain urllib and no API key, as the SDK's CLI and tinker-cookbook's
`weights.download` fetch them; the transformers test loads the download with PEFT on another "machine"
(this process, from the files alone) and compares its logprobs with the server's.
"""

from __future__ import annotations

import io
import tarfile
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import numpy as np
import pyrage
import pytest
import tinker
from tinker import types

from tests.harness import LaunchedServer
from twinkle.auth import tenant_id
from twinkle.download_urls import DownloadSigner, stored_secret

pytestmark = pytest.mark.e2e
BASE = "tiny-qwen"
KEY = "tml-export-e2e"
OTHER = "tml-export-other"
TOKENS = [5 + (i * 3) % 40 for i in range(16)]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def trained_client(server: LaunchedServer, steps: int = 2, *, key: str = KEY,
                   tokens: list[int] = TOKENS) -> tinker.TrainingClient:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    for _ in range(steps):
        fb = tc.forward_backward([datum(tokens)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        fb.result()
    return tc


def rest(server: LaunchedServer, key: str = KEY) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:  # no API key: the URL is the credential
        data: bytes = response.read()
        assert int(response.headers["Content-Length"]) == len(data)
        return data


def status_of(url: str) -> int:
    try:
        urllib.request.urlopen(url, timeout=30).close()
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | changes
    return parts._replace(query=urlencode(query)).geturl()


def checkpoint_dir(server: LaunchedServer, path: str, key: str = KEY) -> Path:
    run, kind, name = path.removeprefix("tinker://").split("/")
    return Path(server.config["storage"]["checkpoint_dir"]) / tenant_id(key) / run / kind / name


def test_external_weights_are_listed_downloaded_renewed_and_deleted_as_the_sdk_expects(
        mock_server: LaunchedServer) -> None:
    tc = trained_client(mock_server, steps=1)
    saved = tc.save_weights_external("final").result()
    assert saved.path == f"tinker://{tc.model_id}/external_weights/final"
    rc = rest(mock_server)
    listed = {c.tinker_path: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[saved.path].checkpoint_type == "external" and listed[saved.path].size_bytes
    assert rc.get_training_run(tc.model_id).result().last_checkpoint is None  # an export is not a resume point

    response = rc.get_external_weights_urls(saved.path).result()
    on_disk = checkpoint_dir(mock_server, saved.path)
    expected = sorted(p.name for p in on_disk.iterdir() if p.name != "checkpoint_metadata.json")
    assert sorted(response.urls) == expected and expected
    assert 3000 < (response.expires - datetime.now(UTC)).total_seconds() <= 3600
    for name, url in response.urls.items():
        assert fetch(url) == (on_disk / name).read_bytes()

    rc.set_checkpoint_ttl_from_tinker_path(saved.path, 3600).result()  # cookbook: renew after signing
    rc.delete_checkpoint_from_tinker_path(saved.path).result()
    assert status_of(next(iter(response.urls.values()))) == 404  # a deleted checkpoint is gone for its URLs too


def test_an_expired_or_altered_url_is_refused_and_another_tenants_checkpoint_is_not_found(
        mock_server: LaunchedServer) -> None:
    tc = trained_client(mock_server, steps=1)
    path = tc.save_weights_external("guarded").result().path
    url = next(iter(rest(mock_server).get_external_weights_urls(path).result().urls.values()))
    assert status_of(url) == 200
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert status_of(with_query(url, expires=str(int(query["expires"]) + 3600))) == 403
    assert status_of(with_query(url, signature=query["signature"][::-1])) == 403
    assert status_of(with_query(url, tenant=tenant_id(OTHER))) == 403
    assert status_of(url.replace("/files/", "/files/x")) == 403  # another file of the same checkpoint

    # the same URL signed with the server's own secret, but already past its expiry
    secret = stored_secret(Path(mock_server.config["storage"]["checkpoint_dir"]))
    subject = f"{path}/{urlsplit(url).path.rsplit('/', 1)[1]}"
    old, _ = DownloadSigner(secret, ttl_seconds=60).sign(tenant_id(KEY), subject, now=1_000_000)
    expired = with_query(url, **old)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(expired, timeout=30)
    assert info.value.code == 403 and b"expired" in info.value.read()

    with pytest.raises(tinker.NotFoundError):
        rest(mock_server, OTHER).get_external_weights_urls(path).result()
    run, _, rest_of = path.removeprefix("tinker://").partition("/")
    with mock_server.client(OTHER) as other:
        assert other.get(f"/training_runs/{run}/checkpoints/{rest_of}/archive").status_code == 404


def test_the_archive_route_redirects_to_a_signed_tar_of_the_checkpoint(mock_server: LaunchedServer) -> None:
    tc = trained_client(mock_server, steps=1)
    path = tc.save_state("arch").result().path
    run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    with mock_server.client(KEY) as client:
        answer = client.get(f"/training_runs/{run}/checkpoints/{checkpoint_id}/archive")
    assert answer.status_code == 302 and answer.headers["Expires"].endswith("GMT")
    assert answer.json()["url"] == answer.headers["Location"]
    data = fetch(answer.headers["Location"])
    on_disk = checkpoint_dir(mock_server, path)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = sorted(tar.getnames())
        assert names == sorted(f"arch/{p.name}" for p in on_disk.iterdir() if p.name != "checkpoint_metadata.json")
        for name in names:
            member = tar.extractfile(name)
            assert member is not None and member.read() == (on_disk / name.split("/", 1)[1]).read_bytes()


def test_copy_weights_makes_a_new_run_holding_the_same_weights_once_per_idempotency_key(
        mock_server: LaunchedServer) -> None:
    tc = trained_client(mock_server, steps=2)
    source = tc.save_state("to-copy").result().path
    rc = rest(mock_server)
    copied = rc.copy_weights(source, "proj-archive").result()
    assert copied != source and copied.endswith("/weights/to-copy")
    copy_run = copied.removeprefix("tinker://").split("/")[0]
    assert rc.get_training_run(copy_run).result().last_checkpoint.tinker_path == copied
    assert rc.get_weights_info_by_tinker_path(copied).result().lora_rank == 8
    assert checkpoint_dir(mock_server, copied).joinpath("checkpoint_metadata.json").is_file()

    service = tinker.ServiceClient(base_url=mock_server.base_url, api_key=KEY)
    restored = service.create_training_client_from_state(copied).result()
    ours = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    theirs = restored.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(ours, theirs)

    with mock_server.client(KEY) as client:
        headers = {"X-Idempotency-Key": "copy-once"}
        body: dict[str, Any] = {"source_path": source, "destination_project_id": "p"}
        first, again = (client.post("/copy_weights", json=body, headers=headers) for _ in range(2))
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json()
        assert client.post("/copy_weights", json={"source_path": source}).status_code == 400
    with pytest.raises(tinker.NotFoundError):
        rest(mock_server, OTHER).copy_weights(source, "p").result()


def test_the_cookbook_download_of_a_training_checkpoint_works_encrypted_end_to_end(
        mock_server: LaunchedServer, tmp_path: Path) -> None:
    """tinker_cookbook.weights.download(tinker_path=.../weights/...), call for call (the cookbook is not a
    dependency): load into a new run, export encrypted to a fresh age key, sign, renew, fetch, decrypt, delete."""
    tc = trained_client(mock_server, steps=1)
    source = tc.save_state("for-download").result().path
    service = tinker.ServiceClient(base_url=mock_server.base_url, api_key=KEY)
    rc = rest(mock_server)
    identity = pyrage.x25519.Identity.generate()
    exporter = service.create_training_client_from_state(source, user_metadata={"created_by": "test"}).result()
    export = exporter.save_weights_external("download", ttl_seconds=3600,
                                            age_encryption_recipients=[str(identity.to_public())]).result().path
    urls = rc.get_external_weights_urls(export).result().urls
    rc.set_checkpoint_ttl_from_tinker_path(export, 3600).result()
    assert urls and all(name.endswith(".age") for name in urls)
    for name, url in urls.items():
        (tmp_path / name).write_bytes(fetch(url))
        pyrage.decrypt_file(str(tmp_path / name), str(tmp_path / name.removesuffix(".age")), [identity])
    plain = checkpoint_dir(mock_server, source)
    for name in urls:
        original, decrypted = plain / name.removesuffix(".age"), tmp_path / name.removesuffix(".age")
        assert original.is_file()
        if original.suffix == ".npz":  # the mock's adapter; the training checkpoint adds the optimizer to it
            with np.load(original) as want, np.load(decrypted) as got:
                assert "down" in got and set(got) <= set(want)
                assert all(np.array_equal(want[k], got[k]) for k in got)
        else:
            assert decrypted.read_bytes() == original.read_bytes()
    rc.delete_checkpoint_from_tinker_path(export).result()

    with pytest.raises(tinker.BadRequestError, match="age recipient"):
        exporter.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result()


def test_an_unknown_route_says_whether_it_is_an_unsupported_sdk_call(mock_server: LaunchedServer) -> None:
    with mock_server.client(KEY) as client:
        audit = client.get("/audit")
        assert audit.status_code == 404 and audit.json()["code"] == "unsupported"
        assert "get_audit_log" in audit.json()["error"] and "does not support" in audit.json()["error"]
        project = client.put("/sessions/s123/project", json={"project_id": "p"})
        assert project.json()["code"] == "unsupported" and "assign_session_project" in project.json()["error"]
        unknown = client.post("/no_such_call", json={})
        assert unknown.status_code == 404 and unknown.json()["code"] == "unknown_route"
        assert "not a Twinkle or Tinker SDK route" in unknown.json()["error"] and unknown.json()["request_id"]
        wrong_method = client.get("/create_model")
        assert wrong_method.status_code == 405 and "POST" in wrong_method.json()["error"]
    with pytest.raises(tinker.NotFoundError, match="does not support"):
        tinker.AdminClient(base_url=mock_server.base_url, api_key=KEY).get_audit_log().result()


@pytest.mark.slow
def test_a_downloaded_adapter_loads_with_peft_and_matches_the_servers_logprobs(
        transformers_server: LaunchedServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc = trained_client(transformers_server, steps=2)
    server_logprobs = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    path = tc.save_weights_external("peft").result().path
    files = tmp_path / "files"
    files.mkdir()
    for name, url in rest(transformers_server).get_external_weights_urls(path).result().urls.items():
        (files / name).write_bytes(fetch(url))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in files.iterdir()}

    run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    with transformers_server.client(KEY) as client:
        location = client.get(f"/training_runs/{run}/checkpoints/{checkpoint_id}/archive").headers["Location"]
    with tarfile.open(fileobj=io.BytesIO(fetch(location))) as tar:
        tar.extractall(tmp_path / "archive", filter="data")
    for p in files.iterdir():
        assert (tmp_path / "archive" / "peft" / p.name).read_bytes() == p.read_bytes()

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "archive" / "peft")).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    local = torch.log_softmax(logits, dim=-1)[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].numpy()
    np.testing.assert_allclose(local, server_logprobs, atol=1e-4)
    with model.disable_adapter(), torch.no_grad():  # the adapter is trained: it changes the answer
        plain = torch.log_softmax(model(torch.tensor([TOKENS[:-1]])).logits[0].float(), dim=-1)
    assert not np.allclose(plain[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].numpy(), local, atol=1e-4)
