from __future__ import annotations

import httpx
import pytest

from tests.client.fake_server import FakeTwinkleServer
from twinkle_client import (
    AuthenticationError,
    ConnectionFailed,
    InternalServerError,
    InvalidArgument,
    NotFoundError,
    RateLimitError,
    RetryPolicy,
    TwinkleClient,
    TwinkleClientError,
)
from twinkle_client.transport import Transport, api_url


@pytest.mark.parametrize(
    "base_url",
    ["http://h:8000", "http://h:8000/", "http://h:8000/api/v1", "http://h:8000/api/v1/", " http://h:8000 "],
)
def test_the_base_url_may_end_in_api_v1_or_not(base_url: str) -> None:
    assert api_url(base_url) == "http://h:8000/api/v1"


def test_a_base_url_without_a_scheme_is_refused_with_an_example() -> None:
    with pytest.raises(InvalidArgument, match="http://host:port"):
        api_url("localhost:8000")


def test_a_429_is_retried_after_the_seconds_retry_after_names(
    client: TwinkleClient, server: FakeTwinkleServer, sleeps: list[float]
) -> None:
    server.inject("GET", "/training_runs", times=2, status=429, retry_after="7")
    assert client.list_training_runs() == []
    assert sleeps == [7.0, 7.0]
    assert len(server.sent("/training_runs")) == 3


def test_retry_after_is_capped_by_the_policy(server: FakeTwinkleServer) -> None:
    waits: list[float] = []
    transport = Transport(
        "http://t",
        server.api_key,
        transport=server.transport(),
        retry=RetryPolicy(retry_after_max=5.0, sleep=waits.append),
    )
    server.inject("GET", "/healthz", status=503, retry_after="3600")
    assert transport.request("GET", "/healthz") == {"status": "ok"}
    assert waits == [5.0]


def test_a_submit_is_retried_on_429_but_not_on_503(
    client: TwinkleClient, server: FakeTwinkleServer, sleeps: list[float]
) -> None:
    server.inject("POST", "/twinkle/encode", status=429, retry_after="1")
    future = client.submit(
        "/twinkle/encode",
        {"template": "Template", "template_kwargs": {}, "rows": []},
        lambda reply: reply["features"],
    )
    assert future.result(timeout=5) == []
    assert sleeps == [1.0]

    server.inject("POST", "/twinkle/encode", status=503, retry_after="1", error="The server's queue is down.")
    with pytest.raises(InternalServerError, match="queue is down") as caught:
        client.submit("/twinkle/encode", {"template": "Template", "template_kwargs": {}, "rows": []}, dict)
    assert caught.value.status == 503 and sleeps == [1.0]


def test_idempotent_calls_retry_503_and_dropped_connections_with_growing_backoff(
    client: TwinkleClient, server: FakeTwinkleServer, sleeps: list[float]
) -> None:
    server.inject("GET", "/get_server_capabilities", status=503)
    server.inject("GET", "/get_server_capabilities", drop_connection=True)
    assert client.get_server_capabilities().supported_models[0].model_name == "Qwen/Qwen3.5-4B"
    assert len(sleeps) == 2
    assert 0.25 <= sleeps[0] <= 0.5 and 0.5 <= sleeps[1] <= 1.0  # base 0.5 s doubling, with jitter


def test_a_refused_connection_is_retried_even_for_a_submit(
    client: TwinkleClient, server: FakeTwinkleServer, sleeps: list[float]
) -> None:
    server.inject("POST", "/twinkle/encode", drop_connection=True)
    future = client.submit(
        "/twinkle/encode",
        {"template": "Template", "template_kwargs": {}, "rows": []},
        lambda reply: reply["features"],
    )
    assert future.result(timeout=5) == [] and len(sleeps) == 1


def test_when_retries_run_out_the_last_error_is_raised_with_the_servers_message(
    client: TwinkleClient, server: FakeTwinkleServer, sleeps: list[float]
) -> None:
    server.inject("GET", "/training_runs", times=10, status=429, retry_after="0", error="Over 10 requests/s.")
    with pytest.raises(RateLimitError, match=r"HTTP 429: Over 10 requests/s\. \(request rid-injected\)"):
        client.list_training_runs()
    assert len(sleeps) == 3  # max_retries of the fixture's policy


def test_a_server_that_cannot_be_reached_raises_connection_failed(server: FakeTwinkleServer) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    transport = Transport(
        "http://t",
        "k",
        transport=httpx.MockTransport(refuse),
        retry=RetryPolicy(max_retries=2, sleep=lambda _: None),
    )
    with pytest.raises(ConnectionFailed, match="Is the server running"):
        transport.request("GET", "/healthz")


def test_a_wrong_api_key_raises_authentication_error_and_is_not_retried(
    server: FakeTwinkleServer, sleeps: list[float]
) -> None:
    with pytest.raises(AuthenticationError, match="API key is not valid"):
        TwinkleClient(
            "http://t", "wrong-key", transport=server.transport(), retry=RetryPolicy(sleep=sleeps.append)
        )
    assert sleeps == []


def test_error_statuses_map_to_their_classes_and_keep_the_request_id(client: TwinkleClient) -> None:
    with pytest.raises(NotFoundError) as caught:
        client.get_training_run("run-404")
    assert caught.value.status == 404
    assert caught.value.request_id == "rid-fake"
    assert "Training run run-404 not found." in str(caught.value)


def test_a_non_json_reply_says_so() -> None:
    transport = Transport(
        "http://t", "k", transport=httpx.MockTransport(lambda r: httpx.Response(200, text="<html>"))
    )
    with pytest.raises(TwinkleClientError, match="not JSON"):
        transport.request("GET", "/healthz")


def test_requests_carry_the_api_key_in_both_headers(client: TwinkleClient, server: FakeTwinkleServer) -> None:
    headers = server.requests[0].headers
    assert headers["x-api-key"] == server.api_key
    assert headers["authorization"] == f"Bearer {server.api_key}"
