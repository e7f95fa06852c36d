"""A cap on the checkpoint saves one API key has outstanding (queued or running) at once.

A save costs a pool far more than a training step (it writes the adapter, maybe its optimizer state, to
disk) and a model pool runs one op at a time, so a key that floods saves makes every other key on the
pool wait behind them. Request rates alone do not stop that: a few saves a second are a modest rate and
a long queue. With the cap, at most `storage.checkpoint_writes_per_key` saves of one key are outstanding;
one more is refused with 429 and Retry-After, which the Tinker SDK obeys on its own.

The outstanding saves of a key are a sorted set of request ids, kept by one Lua script on the Redis
server (twinkle/ledger/saves.py): it drops the ids whose futures have ended (or expired) before it
counts, so nothing has to decrement anything when an op completes, fails, times out or dies with its
worker, and the cap holds across API replicas.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from twinkle.errors import RateLimited
from twinkle.keys import Keys
from twinkle.ledger import AsyncLedger, saves
from twinkle.telemetry import record_rate_limit_rejection

RETRY_AFTER_SECONDS = 1.0  # a save of a LoRA adapter takes about that long
SUBMIT_GRACE_SECONDS = 60  # an id whose future is not written yet: its submit is still under way


class CheckpointWrites:
    def __init__(self, r: aioredis.Redis, keys: Keys, *, per_key: int, future_ttl: int) -> None:
        self.ledger = AsyncLedger(r)
        self.keys = keys
        self.per_key = per_key
        self.future_ttl = future_ttl

    async def reserve(self, owner: str, request_id: str) -> None:
        """Count `request_id` as one of `owner`'s outstanding saves, or raise RateLimited."""
        if self.per_key <= 0:
            return
        outstanding = await self.ledger.run(saves.reserve_save(self.keys, owner, request_id, limit=self.per_key,
                                                               grace=SUBMIT_GRACE_SECONDS, ttl=self.future_ttl))
        if outstanding is None:
            return
        record_rate_limit_rejection("checkpoint_writes", "concurrency")
        raise RateLimited(
            f"This API key already has {outstanding} checkpoint saves queued or running, the server's limit "
            f"({self.per_key}).", hint="Wait for a save to finish before starting the next; the Tinker SDK "
            "retries on its own.", retry_after=RETRY_AFTER_SECONDS, limit=f"{self.per_key} concurrent saves")

    async def release(self, owner: str, request_id: str) -> None:
        """Forget a reservation whose save was never submitted (refused, or a retried duplicate)."""
        if self.per_key > 0:
            await self.ledger.run(saves.release_save(self.keys, owner, request_id))

