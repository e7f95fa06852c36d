"""What a pool published about its model is read at most once a second per API process, and not remembered
while no pool has published it yet."""

from __future__ import annotations

import json
import uuid
from typing import Any

from api.context import ApiContext
from api.pool_state import PoolState
from api.store import Store
from tests.harness import async_redis
from twinkle.catalog import ServedModel
from twinkle.keys import Keys


def context(r: Any, keys: Keys) -> ApiContext:
    store = Store(r, keys, None, future_ttl=60, session_ttl=60)  # type: ignore[arg-type]
    return ApiContext(config=None, store=store, hub=None, catalog=None, keys=keys, auth=None,  # type: ignore[arg-type]
                      checkpoints=None, limiter=None, quotas=None, pools=PoolState(r, keys),  # type: ignore[arg-type]
                      stability=None, usage_history=None)  # type: ignore[arg-type]


async def test_a_pools_model_info_is_read_once_a_second_and_not_before_it_was_published() -> None:
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    served = ServedModel(name="tiny", model_id="/models/tiny", model_app="models-tiny")
    async with async_redis(db=2) as r:
        ctx = context(r, keys)
        try:
            assert await ctx.model_info(served) is None  # no pool started yet
            await r.set(keys.pool_info("models-tiny"), json.dumps({"vocab_size": 512}))
            assert await ctx.model_info(served) == {"vocab_size": 512}  # seen as soon as it is published
            await r.set(keys.pool_info("models-tiny"), json.dumps({"vocab_size": 1024}))
            assert await ctx.model_info(served) == {"vocab_size": 512}  # within the second: not read again
        finally:
            await r.delete(keys.pool_info("models-tiny"))
