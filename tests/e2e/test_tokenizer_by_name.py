"""Tokenizer by model name: a client machine without hub access loads the server's tokenizer through the SDK.

The server serves the tiny model under a hub-style name (`acme/tiny-qwen`), as an operator serving
`Qwen/Qwen3-8B` from a local directory would. The hub is switched off for the client (HF_HUB_OFFLINE), and
the tokenizer must come from the server's tokenizer_files routes, through init_tinker_client.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from transformers import AutoTokenizer

from tests.harness import LaunchedServer, free_port, mock_config, require_redis
from twinkle.tinker_patch import init_tinker_client
from twinkle.tokenizer_cache import fetch_tokenizer_files, served_tokenizer

pytestmark = pytest.mark.e2e
NAME = "acme/tiny-qwen"
KEY = "tml-tokenizer-by-name"
DB = 10  # shared with bench/training.py (benchmarks do not run with the test suite)


@pytest.fixture(scope="module")
def named_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    require_redis()
    tmp = tmp_path_factory.mktemp("named-server")
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=DB)
    config["applications"][1]["args"]["served_model_name"] = NAME  # the model pool also serves sampling
    # Processes at WARNING, as a quiet `launch` runs them: the access log must still be written.
    server = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log", env={"TWINKLE_LOG_LEVEL": "WARNING"})
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def client_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No hub, an empty tokenizer cache: what a fresh client machine has."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TWINKLE_TOKENIZER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    return tmp_path / "cache"


def test_get_info_names_the_hub_style_model_and_the_sdk_loads_its_tokenizer_from_the_server(
    named_server: LaunchedServer, client_machine: Path, tiny_model_dir: Path
) -> None:
    init_tinker_client()
    service = tinker.ServiceClient(base_url=named_server.base_url, api_key=KEY)
    training = service.create_lora_training_client(base_model=NAME, rank=4).result()
    assert training.get_info().model_data.tokenizer_id == NAME

    tokenizer = training.get_tokenizer()
    sampler_tokenizer = service.create_sampling_client(base_model=NAME).get_tokenizer()

    local = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Tokenizers by name: 12 + 30 = 42"
    assert tokenizer.encode(text) == local.encode(text) == sampler_tokenizer.encode(text)
    assert list(client_machine.rglob("tokenizer.json"))  # it came through the cache, not the hub


def test_the_cache_downloads_once_and_a_cookbook_style_loader_reuses_it(
    named_server: LaunchedServer, client_machine: Path
) -> None:
    first = fetch_tokenizer_files(NAME, base_url=named_server.base_url, api_key=KEY)
    assert first is not None and (first / "tokenizer.json").is_file()
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    again = fetch_tokenizer_files(NAME, base_url=named_server.base_url + "/api/v1", api_key=KEY)
    assert again == first and (first / "tokenizer.json").stat().st_mtime_ns == stamp
    # tinker_cookbook.tokenizer_utils.register_tokenizer(NAME, lambda: served_tokenizer(NAME)) calls this:
    assert served_tokenizer(NAME, base_url=named_server.base_url, api_key=KEY).encode("hi")


def test_the_routes_serve_tokenizer_files_only_and_say_what_to_do_otherwise(named_server: LaunchedServer) -> None:
    with httpx.Client(base_url=named_server.api, headers={"X-API-Key": KEY}, timeout=30) as http:
        listing = http.get("/tokenizer_files", params={"model": NAME}).json()
        names = {f["name"] for f in listing["files"]}
        assert listing["model_name"] == NAME and "tokenizer.json" in names
        assert not any(n.endswith((".safetensors", ".bin", ".pt")) for n in names)
        weights = http.get("/tokenizer_files/model.safetensors", params={"model": NAME})
        assert weights.status_code == 404 and "not a tokenizer file" in weights.json()["error"]
        escape = http.get("/tokenizer_files/..%2Fserver.yaml", params={"model": NAME})
        assert escape.status_code == 404
        unknown = http.get("/tokenizer_files", params={"model": "nobody/else"})
        assert unknown.status_code == 400 and NAME in unknown.json()["error"] + unknown.json().get("hint", "")
        assert http.get("/tokenizer_files", params={"model": NAME}, headers={"X-API-Key": ""}).status_code == 401


def test_without_a_server_tokenizer_the_cache_steps_aside(named_server: LaunchedServer, client_machine: Path) -> None:
    assert fetch_tokenizer_files("nobody/else", base_url=named_server.base_url, api_key=KEY) is None
    assert fetch_tokenizer_files(NAME, base_url=None, api_key=KEY) is None  # no server configured


def test_a_404_leaves_an_access_log_line_with_the_request_id_of_its_error_body_even_in_a_quiet_launch(
    named_server: LaunchedServer,
) -> None:
    with httpx.Client(base_url=named_server.api, headers={"X-API-Key": KEY}, timeout=30) as http:
        response = http.post("/no_such_route", json={})
    assert response.status_code == 404
    request_id = response.json()["request_id"]
    deadline = time.monotonic() + 10  # the line is written once the answer is sent, then piped to the log
    while not (lines := [line for line in named_server.log().splitlines() if f"rid={request_id}" in line]):
        assert time.monotonic() < deadline, "no access log line"
        time.sleep(0.05)
    assert len(lines) == 1 and "POST /api/v1/no_such_route 404" in lines[0] and "INFO" in lines[0]
    assert KEY not in named_server.log()


def test_a_quiet_launch_keeps_successful_requests_out_of_its_terminal(named_server: LaunchedServer) -> None:
    with httpx.Client(base_url=named_server.api, headers={"X-API-Key": KEY}, timeout=30) as http:
        fine = http.get("/healthz", headers={"x-request-id": "quiet-success-1"})
        missing = http.post("/no_such_route", json={}, headers={"x-request-id": "quiet-failure-1"})
    assert fine.status_code == 200 and missing.status_code == 404
    deadline = time.monotonic() + 10
    while "rid=quiet-failure-1" not in named_server.log():  # written after the success: the pipe is in order
        assert time.monotonic() < deadline, "no access log line for the failure"
        time.sleep(0.05)
    assert "rid=quiet-success-1" not in named_server.log()
