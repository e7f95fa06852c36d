"""Commands sent together without redis-py's pipeline get the replies its pipeline gets, ride out a lost
connection with the client's retries, and never leave a half-read connection in the pool."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from tests.private_redis import PrivateRedis
from twinkle.round_trip import send_together, send_together_async

BUSY_SCRIPT = "local t = redis.call('TIME'); local stop = t[1] * 1e6 + t[2] + 500000; " \
              "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] >= stop; return 'slow'"


def test_the_replies_are_the_pipelines_errors_and_callbacks_included(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    r.hset("h", mapping={"a": 1, "b": "x"})
    r.set("s", "v")
    sha = r.script_load("return {KEYS[1], ARGV[1], ARGV[2]}")
    commands = [("EVALSHA", sha, 1, "k", 2.5, b"\xff"), ("HGETALL", "h"), ("GET", "s"), ("EVALSHA", "0" * 40, 0),
                ("HGETALL", "missing"), ("INCR", "s"), ("hgetall", "h")]
    pipe = r.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    expected = pipe.execute(raise_on_error=False)

    got = send_together(r, commands)

    assert [type(reply) for reply in got] == [type(reply) for reply in expected]
    assert [reply for reply in got if not isinstance(reply, Exception)] == \
        [reply for reply in expected if not isinstance(reply, Exception)]
    assert isinstance(got[3], NoScriptError) and str(got[5]) == str(expected[5])


def test_a_lost_connection_is_retried_by_the_clients_policy(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url, retry=Retry(NoBackoff(), 3), retry_on_error=[redis.ConnectionError])
    assert send_together(r, [("SET", "k", "1")]) == [True]
    redis.Redis.from_url(broker.url).client_kill_filter(_type="normal", skipme=True)  # every other client's
    assert send_together(r, [("INCR", "k"), ("GET", "k")]) == [2, b"2"]


def test_a_connection_given_up_mid_reply_is_dropped_not_pooled(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.TimeoutError):
        send_together(r, [("PING",), ("EVAL", BUSY_SCRIPT, 0)])
    time.sleep(0.6)  # the script has ended and its late reply arrived: it must not answer the next call
    assert send_together(r, [("ECHO", "next")]) == [b"next"]


def test_the_asyncio_clients_replies_are_its_pipelines_too(broker: PrivateRedis) -> None:
    async def both() -> tuple[list[Any], list[Any]]:
        r = aioredis.Redis.from_url(broker.url)
        await r.hset("h", mapping={"a": 1})
        sha = await r.script_load("return {KEYS[1], ARGV[1]}")
        commands = [("EVALSHA", sha, 1, "k", 7), ("HGETALL", "h"), ("EVALSHA", "0" * 40, 0), ("INCR", "h")]
        pipe = r.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        expected = await pipe.execute(raise_on_error=False)
        got = await send_together_async(r, commands)
        await r.aclose()
        return got, expected

    got, expected = asyncio.run(both())
    assert [type(reply) for reply in got] == [type(reply) for reply in expected]
    assert got[:2] == expected[:2] == [[b"k", b"7"], {b"a": b"1"}]


def test_the_asyncio_client_rides_out_a_lost_connection_too(broker: PrivateRedis) -> None:
    async def after_kill() -> list[Any]:
        r = aioredis.Redis.from_url(broker.url, retry=AsyncRetry(NoBackoff(), 3),
                                    retry_on_error=[redis.ConnectionError])
        await send_together_async(r, [("SET", "k", "1")])
        redis.Redis.from_url(broker.url).client_kill_filter(_type="normal", skipme=True)
        try:
            return await send_together_async(r, [("INCR", "k")])
        finally:
            await r.aclose()

    assert asyncio.run(after_kill()) == [2]


def test_an_argument_redis_cannot_take_is_refused_before_anything_is_sent(broker: PrivateRedis) -> None:
    r = redis.Redis.from_url(broker.url)
    for bad in (None, True):
        with pytest.raises(redis.DataError):
            send_together(r, [("SET", "k", "1"), ("SET", "k", bad)])
    assert r.get("k") is None
