"""The API's Redis clients, and the errors that mean the broker is unreachable (answered 503 by api/errors.py).

Only the storage layer holds a client (the store and its components, listed in tests/api/test_layering.py):
the app builds the clients here and hands them over; routes, services and the console ask the store.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

# Redis runs one command at a time: past a few dozen connections more only cost set-up storms (thousands of
# long-polls waking at once opened hundreds, and connects timed out); requests queue for one instead.
REDIS_CONNECTIONS = 128
# redis-py's default of 5 s counts time the event loop spends on other requests: thousands of long-polls waking
# at once made healthy connects "time out". A stopped or refused broker still fails at once.
REDIS_SOCKET_SECONDS = 20.0
REDIS_POOL_WAIT_SECONDS = 30.0  # past this a request answers 503 (a down broker fails at once, not here)
BROKER_ERRORS: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def redis_client(broker_url: str) -> aioredis.Redis:
    """The API's pooled Redis client.

    A request waits for a free connection (never "too many connections"); parked long-polls hold none. After a
    broker restart a pooled connection can look alive until the event loop reads its EOF, so the first command
    on it fails with "Connection closed by server": each command is retried once, on a fresh connection. A
    broker that is really down refuses that connect at once, so it still answers 503 without delay. Timeouts
    are not retried (that would double the wait on a broker that hangs).
    """
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        broker_url, max_connections=REDIS_CONNECTIONS, timeout=REDIS_POOL_WAIT_SECONDS, health_check_interval=25,
        socket_timeout=REDIS_SOCKET_SECONDS, socket_connect_timeout=REDIS_SOCKET_SECONDS,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))))


def blocking_client(broker_url: str) -> redis.Redis:
    """A plain client for work in a thread of its own (the queue-timeout sweep)."""
    return redis.Redis.from_url(broker_url, socket_timeout=REDIS_SOCKET_SECONDS)
