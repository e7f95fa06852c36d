"""Scripts sent together in one round trip (real Redis): replies in order, a script the server has not loaded
runs all the same, and one call's error leaves the others' replies."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from twinkle.script_batch import ScriptCall, run_together


@pytest.fixture
def r() -> Iterator[redis.Redis]:
    require_redis()
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    yield client
    client.close()


def fresh_script(r: redis.Redis, body: str) -> ScriptCall:
    """A script no server has seen yet (a unique comment gives it a sha of its own), with a key of its own."""
    key = f"test-script-batch-{uuid.uuid4().hex}"
    return ScriptCall(r.register_script(f"-- {uuid.uuid4().hex}\n{body}"), [key], ["7"])


def test_scripts_run_together_answer_in_order_loading_those_the_server_lacks(r: redis.Redis) -> None:
    increment = fresh_script(r, "return redis.call('INCRBY', KEYS[1], ARGV[1])")
    echo = fresh_script(r, "return ARGV[1] .. ':' .. KEYS[1]")
    assert not any(r.script_exists(increment.script.sha, echo.script.sha))
    assert run_together(r, [increment, echo]) == [7, f"7:{echo.keys[0]}".encode()]
    assert run_together(r, [increment]) == [14]  # loaded now: one EVALSHA
    r.delete(increment.keys[0])


def test_a_failing_script_leaves_its_error_in_place_and_the_others_run(r: redis.Redis) -> None:
    failing = fresh_script(r, "return redis.error_reply('no such thing')")
    increment = fresh_script(r, "return redis.call('INCRBY', KEYS[1], ARGV[1])")
    replies = run_together(r, [failing, increment])
    assert isinstance(replies[0], redis.ResponseError) and "no such thing" in str(replies[0])
    assert replies[1] == 7
    r.delete(increment.keys[0])
