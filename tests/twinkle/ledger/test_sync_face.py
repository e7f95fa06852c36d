"""The sync face sends a script and the reads that follow it in one round trip, and survives a broker that forgot its
scripts (a restart without persistence) by running the script on its own."""

from __future__ import annotations

import pytest
import redis

from tests.harness import redis_sends
from twinkle.ledger import SyncLedger
from twinkle.ledger.call import commands, script

COUNT = "return redis.call('INCR', KEYS[1])"


def test_a_script_and_the_reads_after_it_take_one_round_trip_and_the_reads_see_its_write(
        private_client: redis.Redis) -> None:
    ledger = SyncLedger(private_client)
    ledger.run(script(COUNT, ["n"], [], int))  # loaded once
    with redis_sends() as sent:
        count, read = ledger.run_then(script(COUNT, ["n"], [], int), commands(("GET", "n"), decode=lambda r: r[0]))
    assert (count, read, len(sent)) == (2, b"2", 1)


def test_a_script_the_broker_forgot_runs_on_its_own_and_the_reads_still_answer(private_client: redis.Redis) -> None:
    ledger = SyncLedger(private_client)
    ledger.run(script(COUNT, ["n"], [], int))
    private_client.script_flush()
    count, read = ledger.run_then(script(COUNT, ["n"], [], int), commands(("GET", "n"), decode=lambda r: r[0]))
    assert count == 2 and read == b"1"  # the reads ran first, before the script was loaded and run


def test_a_read_that_failed_is_answered_as_its_error_and_a_failed_script_raises(private_client: redis.Redis) -> None:
    ledger = SyncLedger(private_client)
    private_client.set("text", "x")
    count, read = ledger.run_then(script(COUNT, ["n"], [], int), commands(("HGETALL", "text"), decode=dict))
    assert count == 1 and isinstance(read, redis.ResponseError)
    with pytest.raises(redis.ResponseError):
        ledger.run_then(script(COUNT, ["text"], [], int), commands(("GET", "n"), decode=lambda r: r[0]))
