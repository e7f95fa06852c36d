from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, require_redis

DB = 7


@pytest.fixture
def r() -> Iterator[redis.Redis]:
    """A real Redis database of its own, emptied before each test."""
    require_redis()
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=DB)
    client.flushdb()
    yield client
    client.close()
