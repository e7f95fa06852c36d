"""The adapter upload route in process: its own configurable size limit (a 413 that names the setting, declared
or streamed), and refusals that come before a byte of the upload is stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.body_limit import BodyLimit
from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from twinkle.config import parse_config

KEY = {"X-API-Key": "tml-import-route"}
LIMIT = 4096


@pytest.fixture()
def http(tmp_path: Path) -> TestClient:
    require_redis()
    storage = {"max_adapter_upload_bytes": LIMIT, "checkpoint_dir": str(tmp_path)}
    config = parse_config({"storage": storage, "applications": [
        {"name": "m", "route_prefix": "/api/v1/model/x", "import_path": "model",
         "args": {"backend": "mock", "model_id": "/nonexistent/tiny-qwen", "served_model_name": "tiny-qwen"}}]})
    return TestClient(create_app(config, f"redis://{REDIS_HOST}:{REDIS_PORT}/7"), raise_server_exceptions=False)


def chunks(n: int, size: int = 1024) -> Iterator[bytes]:
    for _ in range(n):
        yield b"\0" * size


def test_uploads_have_their_own_limit_apart_from_the_control_routes() -> None:
    limit = BodyLimit(lambda *_: None, max_bytes=64 << 20, max_control_bytes=1 << 20,  # type: ignore[arg-type]
                      max_upload_bytes=1 << 30)
    assert limit.limit_for("/api/v1/import_adapter") == 1 << 30
    assert limit.limit_for("/api/v1/create_session") == 1 << 20
    assert limit.limit_for("/api/v1/forward_backward") == 64 << 20


def test_an_upload_declared_past_the_limit_gets_413_naming_the_setting(http: TestClient) -> None:
    r = http.post("/api/v1/import_adapter", content=b"\0" * (LIMIT + 1),
                  headers={**KEY, "Content-Type": "application/x-tar"})
    assert r.status_code == 413, r.text
    body = r.json()
    assert body["code"] == "payload_too_large" and f"at most {LIMIT} bytes" in body["error"]
    assert "storage.max_adapter_upload_bytes" in body["error"]


def test_a_streamed_upload_past_the_limit_gets_413_while_it_arrives_and_leaves_no_file(http: TestClient,
                                                                                       tmp_path: Path) -> None:
    r = http.post("/api/v1/import_adapter", content=chunks(8),
                  headers={**KEY, "Content-Type": "application/x-tar"})
    assert r.status_code == 413, r.text
    assert "storage.max_adapter_upload_bytes" in r.json()["error"]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_json_content_type_does_not_make_the_upload_collected_in_memory(http: TestClient) -> None:
    r = http.post("/api/v1/import_adapter", content=chunks(8), headers={**KEY, "Content-Type": "application/json"})
    assert r.status_code == 413 and "storage.max_adapter_upload_bytes" in r.json()["error"]


def test_a_base_model_not_served_here_is_refused_before_the_upload_is_read(http: TestClient) -> None:
    r = http.post("/api/v1/import_adapter?base_model=llama", content=b"x", headers=KEY)
    assert r.status_code == 400 and "'llama' is not served here" in r.json()["error"]


def test_a_base_model_without_a_transformers_pool_is_refused_saying_so(http: TestClient) -> None:
    r = http.post("/api/v1/import_adapter?base_model=tiny-qwen", content=b"x", headers=KEY)
    assert r.status_code == 400, r.text
    assert "cannot be imported for tiny-qwen" in r.json()["error"] and "mock backend" in r.json()["error"]


@pytest.mark.parametrize(("query", "message"), [("name=../evil", "Invalid checkpoint name"),
                                                ("ttl_seconds=0", "ttl_seconds")])
def test_bad_query_parameters_are_refused(http: TestClient, query: str, message: str) -> None:
    r = http.post(f"/api/v1/import_adapter?{query}", content=b"x", headers=KEY)
    assert r.status_code == 400 and message in r.text


def test_a_content_encoding_is_refused_with_what_to_send_instead(http: TestClient) -> None:
    r = http.post("/api/v1/import_adapter", content=b"x", headers={**KEY, "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "without Content-Encoding" in r.json()["error"]
