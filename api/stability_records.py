"""The sample requests made with `record_stability_info=True`, which a `stable_reinforce` batch must name
(api/provenance.py checks it): per request its owner, prompt length and number of sequences, under a key that
expires a day after sampling; each training request that uses a record restarts its day."""

from __future__ import annotations

import redis.asyncio as aioredis

from twinkle.keys import Keys

RECORD_TTL_SECONDS = 86400  # "can be trained on for one day after sampling"


class StabilityRecords:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    async def record(self, request_id: str, owner: str, prompt_tokens: int, samples: int) -> None:
        """Remember a sample request made with `record_stability_info=True`."""
        key = self.keys.stability(request_id)
        await self.r.hset(key, mapping={"owner": owner, "prompt_tokens": prompt_tokens, "samples": samples})
        await self.r.expire(key, RECORD_TTL_SECONDS)

    async def read(self, request_ids: list[str]) -> dict[str, dict[bytes, bytes]]:
        """The record of each request id (empty where none is kept)."""
        pipe = self.r.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hgetall(self.keys.stability(request_id))
        return dict(zip(request_ids, await pipe.execute(), strict=True))

    async def renew(self, request_ids: list[str]) -> None:
        """Restart the day of each record."""
        pipe = self.r.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.expire(self.keys.stability(request_id), RECORD_TTL_SECONDS)
        await pipe.execute()
