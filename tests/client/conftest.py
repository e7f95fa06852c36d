from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.client.fake_server import FakeTwinkleServer
from twinkle_client import RetryPolicy, TwinkleClient, init_twinkle_client


@pytest.fixture
def server() -> FakeTwinkleServer:
    return FakeTwinkleServer()


@pytest.fixture
def sleeps() -> list[float]:
    """The waits the client's retry policy asked for (recorded instead of slept)."""
    return []


@pytest.fixture
def client(server: FakeTwinkleServer, sleeps: list[float]) -> Iterator[TwinkleClient]:
    client = init_twinkle_client(
        "http://twinkle.test:8000",
        server.api_key,
        heartbeat_interval=30.0,
        retry=RetryPolicy(max_retries=3, sleep=sleeps.append),
        transport=server.transport(),
    )
    yield client
    client.close()
