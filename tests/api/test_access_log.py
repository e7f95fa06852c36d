"""The access log: one INFO line per request, findable by the request id an error body carries."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from twinkle.auth import tenant_id
from twinkle.config import parse_config

RAW_KEY = "tml-access-log-SECRET-77aa"
LOGGER = "twinkle.api.access"


@pytest.fixture()
def http() -> TestClient:
    # No lifespan (no `with`): these routes answer without Redis, so the test needs no broker.
    config = parse_config({"applications": [
        {"name": "m", "route_prefix": "/api/v1/model/x", "import_path": "model",
         "args": {"backend": "mock", "model_id": "/nonexistent/x"}}]})
    return TestClient(create_app(config, "redis://127.0.0.1:6379/7"), raise_server_exceptions=False)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def test_a_404_leaves_one_line_with_the_request_id_its_error_body_carries(
    http: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    response = http.get("/api/v1/no_such_route", headers={"X-API-Key": RAW_KEY})
    assert response.status_code == 404
    request_id = response.json()["request_id"]
    assert response.headers["x-request-id"] == request_id
    lines = [line for line in access_lines(caplog) if f"rid={request_id}" in line]
    assert len(lines) == 1
    assert lines[0].startswith("GET /api/v1/no_such_route 404 ")
    assert "ms rid=" in lines[0]


def test_a_400_names_the_route_template_and_the_tenant_hash_never_the_key(
    http: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    response = http.post("/api/v1/sessions/s-123/finish", json={"reason": "not-an-object"},
                         headers={"Authorization": f"Bearer {RAW_KEY}"})
    assert response.status_code == 400
    request_id = response.json()["request_id"]
    (line,) = [line for line in access_lines(caplog) if f"rid={request_id}" in line]
    assert line.startswith("POST /api/v1/sessions/{session_id}/finish 400 ")
    assert "s-123" not in line
    assert RAW_KEY not in "\n".join(r.getMessage() for r in caplog.records)


def test_a_success_carries_the_tenant_hash_and_echoes_the_clients_request_id(
    http: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    response = http.post("/api/v1/client/dynamic_config", headers={"X-API-Key": RAW_KEY,
                                                                  "x-request-id": "client-req-42"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-req-42"
    (line,) = [line for line in access_lines(caplog) if "rid=client-req-42" in line]
    assert line.startswith("POST /api/v1/client/dynamic_config 200 ")
    assert line.endswith(f"tenant={tenant_id(RAW_KEY)}")


def test_an_unauthenticated_request_is_logged_without_a_tenant_and_a_forged_id_is_replaced(
    http: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    response = http.post("/api/v1/client/dynamic_config", headers={"x-request-id": "bad id\nFAKE LINE"})
    assert response.status_code == 401
    request_id = response.json()["request_id"]
    assert "FAKE" not in request_id
    (line,) = [line for line in access_lines(caplog) if f"rid={request_id}" in line]
    assert line.endswith("tenant=-")
