"""`paused_capacity`: a queued op whose adapter waits for a LoRA slot, read from what the pool publishes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis

from api.pool_state import PoolState
from api.slots import waiting_for_slot
from tests.harness import REDIS_HOST, REDIS_PORT, mock_config, require_redis
from twinkle.catalog import Catalog
from twinkle.config import parse_config
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys

QUEUE = "model.models-tiny.0"


@pytest.fixture
async def ctx(tmp_path: Path) -> AsyncIterator[Any]:
    require_redis()
    r = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    keys = Keys(f"test-slots-{uuid.uuid4().hex[:8]}:")  # db 1 is shared: a prefix of our own
    config = parse_config(mock_config(tmp_path, tmp_path / "checkpoints", port=1, db=1, max_loras=2))
    yield SimpleNamespace(catalog=Catalog(config), pools=PoolState(r, keys), keys=keys, redis=r)
    await r.delete(keys.pool_adapters(QUEUE))
    await r.aclose()


def queued(model_id: str, status: FutureStatus = FutureStatus.QUEUED) -> FutureRecord:
    return FutureRecord(request_id="r1", op="forward_backward", owner="o", model_id=model_id, queue=QUEUE,
                        status=status)


async def test_a_queued_op_of_a_paged_out_adapter_waits_for_a_slot_when_every_slot_holds_another(ctx: Any) -> None:
    await ctx.redis.sadd(ctx.keys.pool_adapters(QUEUE), "a", "b")
    reason = await waiting_for_slot(ctx, queued("c"))
    assert reason is not None and "all 2 LoRA slots" in reason and "paged in when its turn comes" in reason


async def test_an_op_does_not_wait_for_a_slot_when_its_adapter_is_resident_or_a_slot_is_free(ctx: Any) -> None:
    await ctx.redis.sadd(ctx.keys.pool_adapters(QUEUE), "a")
    assert await waiting_for_slot(ctx, queued("c")) is None  # one slot free
    await ctx.redis.sadd(ctx.keys.pool_adapters(QUEUE), "b")
    assert await waiting_for_slot(ctx, queued("a")) is None  # resident
    assert await waiting_for_slot(ctx, queued("c", FutureStatus.RUNNING)) is None  # it got its slot


async def test_ops_outside_a_model_queue_never_wait_for_a_slot(ctx: Any) -> None:
    record = FutureRecord(request_id="r1", op="sample", owner="o", model_id="", queue="sampler.x")
    assert await waiting_for_slot(ctx, record) is None
