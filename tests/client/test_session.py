from __future__ import annotations

import atexit
import time

import pytest

from tests.client.fake_server import FakeTwinkleServer
from twinkle_client import (
    InvalidArgument,
    TwinkleClient,
    TwinkleClientError,
    current_client,
    init_twinkle_client,
)


def wait_for(condition: object, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_a_session_is_created_at_init_and_kept_alive_by_heartbeats(server: FakeTwinkleServer) -> None:
    client = TwinkleClient("http://t", server.api_key, heartbeat_interval=0.02, transport=server.transport())
    session = server.sessions[client.session_id]
    assert session["sdk_version"].startswith("twinkle_client/")
    wait_for(lambda: session["heartbeats"] >= 3)
    assert session["heartbeats"] >= 3
    client.close()


def test_close_stops_the_heartbeat_thread_and_finishes_the_session(server: FakeTwinkleServer) -> None:
    client = TwinkleClient("http://t", server.api_key, heartbeat_interval=0.02, transport=server.transport())
    wait_for(lambda: client.session.heartbeats_sent >= 1)
    client.close()
    assert not client.session.alive
    session = server.sessions[client.session_id]
    assert session["finished"] == "success"
    beats = session["heartbeats"]
    time.sleep(0.1)
    assert session["heartbeats"] == beats
    client.close()  # a second close does nothing
    assert len(server.sent(f"/sessions/{client.session_id}/finish")) == 1


def test_the_context_manager_closes_the_client(server: FakeTwinkleServer) -> None:
    with TwinkleClient("http://t", server.api_key, transport=server.transport()) as client:
        assert client.health_check()
    assert client.closed and not client.session.alive
    with pytest.raises(TwinkleClientError, match="closed"):
        client.list_training_runs()


def test_close_is_registered_at_exit_and_unregistered_by_close(
    server: FakeTwinkleServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered: list[object] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", registered.remove)
    client = TwinkleClient("http://t", server.api_key, transport=server.transport())
    assert registered == [client.close]
    client.close()
    assert registered == []


def test_heartbeats_stop_when_the_server_forgot_the_session(
    server: FakeTwinkleServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = TwinkleClient("http://t", server.api_key, heartbeat_interval=0.02, transport=server.transport())
    del server.sessions[client.session_id]
    wait_for(lambda: not client.session.alive)
    assert not client.session.alive
    assert "no longer knows session" in caplog.text
    client.close()


def test_a_failing_heartbeat_is_logged_once_and_retried_on_the_next_beat(
    server: FakeTwinkleServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.inject("POST", "/session_heartbeat", times=3, status=503)
    client = TwinkleClient("http://t", server.api_key, heartbeat_interval=0.02, transport=server.transport())
    wait_for(lambda: client.session.heartbeats_sent >= 1)
    client.close()
    assert client.session.heartbeats_sent >= 1
    assert caplog.text.count("Heartbeat for session") == 1


def test_init_reads_the_url_and_key_from_the_environment(
    server: FakeTwinkleServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TWINKLE_SERVER_URL", "http://twinkle.env:9000/api/v1")
    monkeypatch.setenv("TWINKLE_SERVER_TOKEN", server.api_key)
    client = init_twinkle_client(transport=server.transport())
    assert client.base_url == "http://twinkle.env:9000/api/v1"
    assert current_client() is client
    client.close()
    with pytest.raises(InvalidArgument, match="init_twinkle_client"):
        current_client()


def test_init_without_any_key_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINKLE_SERVER_TOKEN", raising=False)
    with pytest.raises(InvalidArgument, match="TWINKLE_SERVER_TOKEN"):
        init_twinkle_client("http://t")
