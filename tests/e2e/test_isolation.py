"""Tenants on one server: keys from a keys file, every route refusing another key's ids with 404, client
paths confined to the tenant's directory, and raw keys nowhere in state, logs or checkpoint paths."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_foundation import datum, fb_body, wait
from tests.harness import LaunchedServer, launch
from twinkle.auth import tenant_id
from twinkle.keys_file import add_key
from twinkle.server.cli import main as cli

pytestmark = pytest.mark.e2e

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}


@dataclass
class Tenant:
    key: str
    session_id: str
    model_id: str
    future_id: str
    checkpoint: str
    sampler_checkpoint: str
    sampling_session_id: str

    @property
    def tenant(self) -> str:
        return tenant_id(self.key)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys") / "api_keys"


@pytest.fixture(scope="module")
def raw_keys(keys_file: Path) -> dict[str, str]:
    return {label: add_key(keys_file, label, prefix="tml-")[0] for label in ("alice", "bob")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, keys_file: Path,
           raw_keys: dict[str, str]) -> Iterator[LaunchedServer]:
    server = launch(tmp_path_factory.mktemp("isolation"), tiny_model_dir, db=4, sampler=True,
                    auth={"keys_file": str(keys_file)})
    yield server
    server.stop()


def make_tenant(server: LaunchedServer, key: str) -> Tenant:
    with server.client(key) as c:
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        created = c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen",
                                                "lora_config": {"rank": 4}}).json()
        model = created["model_id"]
        wait(c, created["request_id"])
        future = c.post("/forward_backward", json=fb_body(model, [datum([1, 2, 3, 4])])).json()["request_id"]
        wait(c, future)
        saved = wait(c, c.post("/save_weights", json={"model_id": model, "path": "ck1"}).json()["request_id"])
        sampler = wait(c, c.post("/save_weights_for_sampler", json={"model_id": model, "path": "s1"}).json()[
            "request_id"])
        sampling = c.post("/create_sampling_session", json={"session_id": sid, "model_path": sampler["path"]})
        assert sampling.status_code == 200, sampling.text
        return Tenant(key, sid, model, future, saved["path"], sampler["path"], sampling.json()["sampling_session_id"])


@pytest.fixture(scope="module")
def alice(server: LaunchedServer, raw_keys: dict[str, str]) -> Tenant:
    return make_tenant(server, raw_keys["alice"])


@pytest.fixture(scope="module")
def bob(server: LaunchedServer, raw_keys: dict[str, str]) -> Tenant:
    return make_tenant(server, raw_keys["bob"])


# (method, route template, body) for every route that takes an id; `a` is the owner, `b` the caller's own.
def id_routes(a: Tenant, b: Tenant) -> list[tuple[str, str, str, Any]]:
    run, ck = a.model_id, "weights/ck1"
    return [
        ("POST", "/retrieve_future", "/retrieve_future", {"request_id": a.future_id}),
        ("POST", "/create_model", "/create_model", {"session_id": a.session_id, "base_model": "tiny-qwen"}),
        ("POST", "/get_info", "/get_info", {"model_id": run}),
        ("POST", "/forward_backward", "/forward_backward", fb_body(run, [datum([1, 2, 3])])),
        ("POST", "/forward", "/forward", fb_body(run, [datum([1, 2, 3])])),
        ("POST", "/optim_step", "/optim_step", {"model_id": run, "adam_params": {}}),
        ("POST", "/save_weights", "/save_weights", {"model_id": run, "path": "stolen"}),
        ("POST", "/save_weights_for_sampler", "/save_weights_for_sampler", {"model_id": run}),
        ("POST", "/load_weights", "/load_weights", {"model_id": run, "path": a.checkpoint}),
        ("POST", "/load_weights", "/load_weights", {"model_id": b.model_id, "path": a.checkpoint}),
        ("POST", "/load_weights", "/load_weights", {"session_id": b.session_id, "path": a.checkpoint}),
        ("POST", "/load_weights", "/load_weights", {"session_id": a.session_id, "path": b.checkpoint}),
        ("POST", "/unload_model", "/unload_model", {"model_id": run}),
        ("POST", "/session_heartbeat", "/session_heartbeat", {"session_id": a.session_id}),
        ("POST", "/sessions/{session_id}/finish", f"/sessions/{a.session_id}/finish", {}),
        ("GET", "/sessions/{session_id}", f"/sessions/{a.session_id}", None),
        ("POST", "/create_sampling_session", "/create_sampling_session",
         {"session_id": a.session_id, "base_model": "tiny-qwen"}),
        ("POST", "/create_sampling_session", "/create_sampling_session",
         {"session_id": b.session_id, "model_path": a.sampler_checkpoint}),
        ("GET", "/samplers/{sampler_id}", f"/samplers/{a.sampling_session_id}", None),
        ("POST", "/asample", "/asample", {"sampling_session_id": a.sampling_session_id, "prompt": PROMPT}),
        ("POST", "/asample", "/asample", {"model_path": a.sampler_checkpoint, "prompt": PROMPT}),
        ("GET", "/training_runs/{run_id}", f"/training_runs/{run}", None),
        ("GET", "/training_runs/{run_id}/checkpoints", f"/training_runs/{run}/checkpoints", None),
        ("POST", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish",
         f"/training_runs/{run}/checkpoints/{ck}/publish", None),
        ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish",
         f"/training_runs/{run}/checkpoints/{ck}/publish", None),
        ("PUT", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl",
         f"/training_runs/{run}/checkpoints/{ck}/ttl", {"ttl_seconds": 5}),
        ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id}",
         f"/training_runs/{run}/checkpoints/{ck}", None),
        ("POST", "/weights_info", "/weights_info", {"tinker_path": a.checkpoint}),
        ("POST", "/save_weights_external", "/save_weights_external", {"model_id": run, "path": "stolen"}),
        ("GET", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/external_weights_urls",
         f"/training_runs/{run}/checkpoints/{ck}/external_weights_urls", None),
        ("GET", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/archive",
         f"/training_runs/{run}/checkpoints/{ck}/archive", None),
        ("POST", "/export_merged", "/export_merged", {"path": a.checkpoint}),
        ("GET", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/merged_urls",
         f"/training_runs/{run}/checkpoints/{ck}/merged_urls", None),
        ("GET", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/merged_archive",
         f"/training_runs/{run}/checkpoints/{ck}/merged_archive", None),
        ("POST", "/copy_weights", "/copy_weights", {"source_path": a.checkpoint, "destination_project_id": "p"}),
        ("POST", "/copy_weights", "/copy_weights",
         {"source_path": b.checkpoint, "session_id": a.session_id, "model_seq_id": 7}),
        ("POST", "/twinkle/configure", "/twinkle/configure", {"model_id": run}),
        ("POST", "/twinkle/forward_backward", "/twinkle/forward_backward",
         {"model_id": run, "inputs": [{"input_ids": [1, 2], "labels": [1, 2]}]}),
        ("POST", "/twinkle/forward_only", "/twinkle/forward_only",
         {"model_id": run, "inputs": [{"input_ids": [1, 2], "labels": [1, 2]}]}),
        ("POST", "/twinkle/clip_grad_and_step", "/twinkle/clip_grad_and_step", {"model_id": run}),
        ("POST", "/twinkle/calculate_metric", "/twinkle/calculate_metric", {"model_id": run}),
        ("POST", "/twinkle/get_train_configs", "/twinkle/get_train_configs", {"model_id": run}),
        ("POST", "/twinkle/save", "/twinkle/save", {"model_id": run, "name": "stolen"}),
        ("POST", "/twinkle/resume_from_checkpoint", "/twinkle/resume_from_checkpoint",
         {"model_id": run, "path": a.checkpoint}),
        ("POST", "/twinkle/resume_from_checkpoint", "/twinkle/resume_from_checkpoint",
         {"model_id": b.model_id, "path": a.checkpoint}),
        ("POST", "/twinkle/upload_to_hub", "/twinkle/upload_to_hub",
         {"model_id": run, "checkpoint_dir": a.checkpoint, "hub_model_id": "x/y"}),
        ("POST", "/twinkle/upload_to_hub", "/twinkle/upload_to_hub",
         {"model_id": b.model_id, "checkpoint_dir": a.checkpoint, "hub_model_id": "x/y"}),
    ]


# Routes that take no id of anyone's: they answer about the caller alone (or about the server).
ID_FREE = {
    ("GET", "/healthz"), ("POST", "/client/config"), ("POST", "/client/dynamic_config"),
    ("GET", "/get_server_capabilities"), ("POST", "/create_session"), ("POST", "/telemetry"),
    ("GET", "/training_runs"), ("GET", "/checkpoints"), ("GET", "/sessions"),
    ("GET", "/twinkle/capacity_info"), ("POST", "/twinkle/encode"),
    ("GET", "/tokenizer_files"), ("GET", "/tokenizer_files/{name}"),  # the served model's, the same for every key
    ("GET", "/usage"),  # another tenant's only for operators' keys (tests/api/test_usage_report.py)
    # a new run of the caller's own; another key cannot load or see it (tests/e2e/test_adapter_import.py)
    ("POST", "/import_adapter"),
}


# Download routes take no key: a signed URL is the credential (tests/e2e/test_weight_export.py, and below).
SIGNED = {("GET", "/downloads/{run_id}/{kind}/{name}/files/{file_path}"),
          ("GET", "/downloads/{run_id}/{kind}/{name}/archive.tar"),
          ("GET", "/downloads/{run_id}/{kind}/{name}/merged/files/{file_path}"),  # tests/e2e/test_merged_export.py
          ("GET", "/downloads/{run_id}/{kind}/{name}/merged/archive.tar")}


# OpenAI-compatible routes (outside /api/v1, errors in OpenAI's shape): another key's adapter is a 404 there too,
# tested with the openai client in tests/e2e/test_openai_endpoint.py.
OPENAI = {("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")}


def request(c: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    return c.request(method, path, json=body) if body is not None else c.request(method, path)


def test_every_route_is_in_the_isolation_table(server: LaunchedServer, alice: Tenant, bob: Tenant) -> None:
    spec = httpx.get(server.base_url + "/openapi.json").json()
    routes = {(method.upper(), path.removeprefix("/api/v1").replace("{checkpoint_id:path}", "{checkpoint_id}"))
              for path, methods in spec["paths"].items() for method in methods}
    covered = {(m, template) for m, template, _, _ in id_routes(alice, bob)} | ID_FREE | SIGNED | OPENAI
    assert routes - covered == set(), "add these routes to the isolation table"


def test_another_key_gets_404_from_every_route_for_the_first_keys_ids(server: LaunchedServer, alice: Tenant,
                                                                        bob: Tenant) -> None:
    with server.client(bob.key) as intruder:
        for method, _, path, body in id_routes(alice, bob):
            r = request(intruder, method, path, body)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            assert r.json()["code"] == "not_found", (method, path, r.text)
            assert alice.tenant not in r.text and "checkpoint_metadata" not in r.text, (method, path, r.text)
    # nothing the intruder tried changed the owner's things
    with server.client(alice.key) as owner:
        assert owner.post("/get_info", json={"model_id": alice.model_id}).status_code == 200
        assert owner.get(f"/sessions/{alice.session_id}").status_code == 200
        checkpoints = owner.get(f"/training_runs/{alice.model_id}/checkpoints").json()["checkpoints"]
        ck1 = next(c for c in checkpoints if c["checkpoint_id"] == "weights/ck1")
        assert ck1["public"] is False and ck1["expires_at"] is None
        assert "stolen" not in str(checkpoints)
        assert owner.post("/weights_info", json={"tinker_path": alice.checkpoint}).status_code == 200
        assert "metrics" in wait(owner, owner.post("/forward_backward", json=fb_body(
            alice.model_id, [datum([1, 2, 3])])).json()["request_id"])


def test_a_download_url_signed_for_one_key_does_not_open_another_keys_checkpoint(
        server: LaunchedServer, alice: Tenant, bob: Tenant) -> None:
    with server.client(bob.key) as c:
        own_run, own_ck = bob.checkpoint.removeprefix("tinker://").split("/", 1)
        own = c.get(f"/training_runs/{own_run}/checkpoints/{own_ck}/archive").headers["Location"]
    alice_run = alice.checkpoint.removeprefix("tinker://").split("/")[0]
    stolen = own.replace(own_run, alice_run)  # bob's valid signature, alice's checkpoint
    assert httpx.get(stolen).status_code == 403
    unsigned = own.split("?")[0].replace(own_run, alice_run) + f"?tenant={alice.tenant}"
    assert httpx.get(unsigned).status_code == 403
    assert httpx.get(own).status_code == 200


def test_listings_show_only_the_callers_own_things(server: LaunchedServer, alice: Tenant, bob: Tenant) -> None:
    with server.client(bob.key) as c:
        listings = [c.get(path) for path in ("/training_runs", "/checkpoints", "/sessions")]
        assert all(r.status_code == 200 for r in listings)
        text = " ".join(r.text for r in listings)
        assert bob.model_id in text and bob.session_id in text
        assert alice.model_id not in text and alice.session_id not in text and alice.tenant not in text


def test_requests_without_a_valid_key_get_401(server: LaunchedServer, alice: Tenant) -> None:
    for headers in ({}, {"X-API-Key": "tml-not-a-key"}, {"Authorization": "Bearer tml-not-a-key"},
                    {"Authorization": f"Basic {alice.key}"}):
        r = httpx.post(server.api + "/get_info", json={"model_id": alice.model_id}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["code"] == "unauthenticated" and "key" in r.json()["error"]
    r = httpx.post(server.api + "/get_info", json={"model_id": alice.model_id},
                   headers={"Authorization": f"Bearer {alice.key}"})
    assert r.status_code == 200


def test_a_key_added_or_revoked_by_the_cli_takes_effect_within_seconds_without_restart(
        server: LaunchedServer, keys_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["keys", "add", "--label", "carol", "--prefix", "tml-", "--keys-file", str(keys_file)]) == 0
    carol = capsys.readouterr().out.strip()

    def status() -> int:
        return httpx.post(server.api + "/create_session", json={}, headers={"X-API-Key": carol}).status_code

    assert _within(2.5, lambda: status() == 200)
    assert cli(["keys", "revoke", "carol", "--keys-file", str(keys_file)]) == 0
    assert _within(2.5, lambda: status() == 401)


@pytest.mark.parametrize("path", [
    "tinker://../x/weights/y", "tinker://run/weights/../../../../etc", "tinker://run/weights/..",
    "tinker://run/weights/.hidden", "tinker:///etc/passwd", "/etc/passwd", "file:///etc/passwd",
    "../../outside", "tinker://run/../weights/y", "twinkle://run/weights/a/b",
])
def test_path_traversal_in_checkpoint_paths_is_refused(server: LaunchedServer, alice: Tenant, path: str) -> None:
    with server.client(alice.key) as c:
        attempts = [
            c.post("/load_weights", json={"model_id": alice.model_id, "path": path}),
            c.post("/weights_info", json={"tinker_path": path}),
            c.post("/create_sampling_session", json={"session_id": alice.session_id, "model_path": path}),
            c.post("/asample", json={"model_path": path, "prompt": PROMPT}),
        ]
        for r in attempts:
            assert 400 <= r.status_code < 500, (path, r.text)
            assert "/tmp" not in r.text and "Traceback" not in r.text


@pytest.mark.parametrize("name", ["../evil", "/abs/evil", "a/b", "..", ".hidden", "x" * 201])
def test_traversal_in_checkpoint_names_is_refused(server: LaunchedServer, alice: Tenant, name: str) -> None:
    with server.client(alice.key) as c:
        for route in ("/save_weights", "/save_weights_for_sampler"):
            r = c.post(route, json={"model_id": alice.model_id, "path": name})
            assert r.status_code == 400, (route, name, r.text)
        r = c.delete(f"/training_runs/{alice.model_id}/checkpoints/weights/{name}")
        assert 400 <= r.status_code < 500, r.text


def test_symlinks_planted_in_a_tenant_directory_do_not_lead_out_of_it(server: LaunchedServer, alice: Tenant,
                                                                        bob: Tenant, tmp_path: Path) -> None:
    root = Path(server.config["storage"]["checkpoint_dir"]).resolve()
    own_run = root / alice.tenant / alice.model_id
    outside = tmp_path / "outside-checkpoint"
    shutil.copytree(own_run / "weights" / "ck1", outside)  # a well-formed checkpoint, outside the tenant
    (own_run / "weights" / "planted").symlink_to(outside, target_is_directory=True)
    (root / alice.tenant / "borrowed-run").symlink_to(root / bob.tenant / bob.model_id, target_is_directory=True)
    with server.client(alice.key) as c:
        for path in (f"tinker://{alice.model_id}/weights/planted", "tinker://borrowed-run/weights/ck1",
                     f"tinker://{bob.model_id}/weights/ck1"):
            for r in (c.post("/load_weights", json={"model_id": alice.model_id, "path": path}),
                      c.post("/weights_info", json={"tinker_path": path}),
                      c.post("/create_sampling_session", json={"session_id": alice.session_id,
                                                               "model_path": path})):
                assert r.status_code == 404, (path, r.text)
                assert str(root) not in r.text and str(outside) not in r.text


def test_raw_keys_appear_nowhere_in_redis_logs_or_checkpoints(server: LaunchedServer, alice: Tenant, bob: Tenant,
                                                              raw_keys: dict[str, str]) -> None:
    secrets = [k.encode() for k in raw_keys.values()]
    r = server.redis
    found: list[bytes] = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key)
        values: list[Any]
        if kind == b"string":
            values = [r.get(key) or b""]
        elif kind == b"hash":
            values = [b for kv in r.hgetall(key).items() for b in kv]
        elif kind == b"set":
            values = list(r.smembers(key))
        elif kind == b"zset":
            values = list(r.zrange(key, 0, -1))
        elif kind == b"list":
            values = list(r.lrange(key, 0, -1))
        else:
            values = []
        blob = bytes(key) + b"".join(bytes(v) for v in values)
        found.extend(key for s in secrets if s in blob)
    assert found == []
    log = server.log()
    assert all(k not in log for k in raw_keys.values())
    root = Path(server.config["storage"]["checkpoint_dir"])
    for directory, dirs, files in os.walk(root):
        for name in [directory, *dirs, *files]:
            assert all(k not in name for k in raw_keys.values())
        for name in files:
            path = Path(directory) / name
            if path.is_file():
                assert all(s not in path.read_bytes() for s in secrets)


def _within(seconds: float, condition: Any) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_get_server_capabilities_needs_a_valid_key_when_keys_are_configured(server: LaunchedServer,
                                                                           alice: Tenant) -> None:
    for headers in ({}, {"X-API-Key": "tml-not-a-key"}):
        r = httpx.get(server.api + "/get_server_capabilities", headers=headers)
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", (headers, r.text)
    r = httpx.get(server.api + "/get_server_capabilities", headers={"X-API-Key": alice.key})
    assert r.status_code == 200 and r.json()["supported_models"][0]["model_name"] == "tiny-qwen"


def test_get_server_capabilities_stays_open_in_development_mode(mock_server: LaunchedServer) -> None:
    assert httpx.get(mock_server.api + "/get_server_capabilities").status_code == 200
