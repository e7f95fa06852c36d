"""What the pools publish and hold, as the API reads it: model info, the adapters in a replica's slots and pinned
to it, and each pool's readings for the console in one round trip."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from api.pool_state import PoolState
from tests.harness import scratch_keys
from twinkle.ledger.call import commands

QUEUE = "model.tiny.0"


@pytest.fixture
async def pools() -> AsyncIterator[PoolState]:
    async with scratch_keys() as (r, keys):
        yield PoolState(r, keys)


async def test_a_pools_model_info_is_none_until_the_pool_publishes_it(pools: PoolState) -> None:
    assert await pools.model_info("tiny") is None
    await pools.r.set(pools.keys.pool_info("tiny"), json.dumps({"vocab_size": 512}))
    assert await pools.model_info("tiny") == {"vocab_size": 512}


async def test_a_replicas_slots_say_whether_an_adapter_is_resident_and_how_many_are_taken(pools: PoolState) -> None:
    await pools.r.sadd(pools.keys.pool_adapters(QUEUE), "a", "b")
    await pools.r.sadd(pools.keys.pool_assigned(QUEUE), "a", "b", "c")
    assert await pools.slot_use(QUEUE, "a") == (True, 2)
    assert await pools.slot_use(QUEUE, "c") == (False, 2)
    assert await pools.resident_adapters(QUEUE) == 2
    assert await pools.assigned_adapters([QUEUE, "model.tiny.1"]) == [3, 0]


async def test_the_console_reads_every_pool_and_a_ledger_call_in_one_round_trip(pools: PoolState) -> None:
    await pools.r.set(pools.keys.pool_heartbeat(QUEUE), 1)
    await pools.r.sadd(pools.keys.pool_adapters(QUEUE), "a")
    along = commands(("PING",), decode=lambda replies: replies[0])
    states, staged = await pools.readings([QUEUE, "sampler.tiny"], along)
    assert states == [(True, 1, 0, 0), (False, 0, 0, 0)]
    assert staged is True
