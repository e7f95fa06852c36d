"""What the pools publish and hold in Redis, as the API reads it: each pool's model info and linear-layer shapes,
the adapters resident in a model replica's slots and those pinned to it, and the reservations full-parameter
runs hold (api/reservations.py)."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from api.reservations import refuse_while_held, waiting_reason
from twinkle.futures import FutureRecord
from twinkle.keys import Keys
from twinkle.ledger.call import Call


class PoolState:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    async def model_info(self, app: str) -> dict[str, Any] | None:
        """What the app's pool published about its loaded model (None before a pool started)."""
        raw = await self.r.get(self.keys.pool_info(app))
        if not raw:
            return None
        info: dict[str, Any] = json.loads(raw)
        return info

    async def lora_modules(self, app: str) -> Any:
        """The linear layers (and their shapes) the app's pool published, as JSON; None where it published none."""
        raw = await self.r.get(self.keys.pool_lora_modules(app))
        return json.loads(raw) if raw else None

    async def resident_adapters(self, queue: str) -> int:
        """How many adapters the model replica holds in its slots."""
        return int(await self.r.scard(self.keys.pool_adapters(queue)) or 0)

    async def assigned_adapters(self, queues: list[str]) -> list[int]:
        """How many active adapters are pinned to each replica, resident or paged out."""
        pipe = self.r.pipeline(transaction=False)
        for queue in queues:
            pipe.scard(self.keys.pool_assigned(queue))
        return [int(held) for held in await pipe.execute()]

    async def slot_use(self, queue: str, model_id: str) -> tuple[bool, int]:
        """Whether the model's adapter is resident in the replica's slots, and how many slots are taken."""
        pipe = self.r.pipeline(transaction=False)
        pipe.sismember(self.keys.pool_adapters(queue), model_id)
        pipe.scard(self.keys.pool_adapters(queue))
        resident, used = await pipe.execute()
        return bool(resident), int(used)

    async def readings(self, queues: list[str], along: Call[Any]) -> tuple[list[tuple[bool, int, int, int]], Any]:
        """Per queue in one round trip: whether its pool beats, its resident and its assigned adapters, and the
        messages waiting in it; and the raw reply of the ledger call `along`, sent with them."""
        pipe = self.r.pipeline(transaction=False)
        for queue in queues:
            pipe.exists(self.keys.pool_heartbeat(queue))
            pipe.scard(self.keys.pool_adapters(queue))
            pipe.scard(self.keys.pool_assigned(queue))
            pipe.llen(queue)
        along.stage(pipe)
        *replies, staged = await pipe.execute()
        return [(bool(replies[i]), int(replies[i + 1]), int(replies[i + 2]), int(replies[i + 3]))
                for i in range(0, len(replies), 4)], staged

    async def refuse_while_held(self, queue: str, model_id: str) -> None:
        """Raise PoolReserved for an op of any run but the holder of a reserved pool that refuses meanwhile."""
        await refuse_while_held(self.r, self.keys, queue, model_id)

    async def reservation_wait(self, record: FutureRecord) -> str | None:
        """Why a queued op of another run waits for its reserved pool (None: it does not)."""
        return await waiting_reason(self.r, self.keys, record)
