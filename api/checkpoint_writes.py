"""A cap on the checkpoint saves one API key has outstanding (queued or running) at once.

A save costs a pool far more than a training step (it writes the adapter, maybe its optimizer state, to
disk) and a model pool runs one op at a time, so a key that floods saves makes every other key on the
pool wait behind them. Request rates alone do not stop that: a few saves a second are a modest rate and
a long queue. With the cap, at most `storage.checkpoint_writes_per_key` saves of one key are outstanding;
one more is refused with 429 and Retry-After, which the Tinker SDK obeys on its own.

The outstanding saves of a key are a sorted set of request ids, kept by one Lua script on the Redis
server: it drops the ids whose futures have ended (or expired) before it counts, so nothing has to
decrement anything when an op completes, fails, times out or dies with its worker, and the cap holds
across API replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from twinkle.errors import RateLimited
from twinkle.futures import new_request_id
from twinkle.keys import Keys
from twinkle.records import ModelRecord
from twinkle.telemetry import record_rate_limit_rejection
from twinkle.tenancy import TenantPolicy

if TYPE_CHECKING:
    from api.context import ApiContext

RETRY_AFTER_SECONDS = 1.0  # a save of a LoRA adapter takes about that long
SUBMIT_GRACE_SECONDS = 60  # an id whose future is not written yet: its submit is still under way


class CheckpointWrites:
    def __init__(self, r: aioredis.Redis, keys: Keys, *, per_key: int, future_ttl: int) -> None:
        self.r = r
        self.keys = keys
        self.per_key = per_key
        self.future_ttl = future_ttl
        self._reserve = r.register_script(_RESERVE)

    async def reserve(self, owner: str, request_id: str) -> None:
        """Count `request_id` as one of `owner`'s outstanding saves, or raise RateLimited."""
        if self.per_key <= 0:
            return
        outstanding = int(await self._reserve(
            keys=[self.keys.checkpoint_writes(owner)],
            args=[self.keys.future(""), request_id, self.per_key, SUBMIT_GRACE_SECONDS, self.future_ttl]))
        if outstanding < 0:
            return
        record_rate_limit_rejection("checkpoint_writes", "concurrency")
        raise RateLimited(
            f"This API key already has {outstanding} checkpoint saves queued or running, the server's limit "
            f"({self.per_key}).", hint="Wait for a save to finish before starting the next; the Tinker SDK "
            "retries on its own.", retry_after=RETRY_AFTER_SECONDS, limit=f"{self.per_key} concurrent saves")

    async def release(self, owner: str, request_id: str) -> None:
        """Forget a reservation whose save was never submitted (refused, or a retried duplicate)."""
        if self.per_key > 0:
            await self.r.zrem(self.keys.checkpoint_writes(owner), request_id)


# KEYS: the owner's set. ARGV: future key prefix, request id, limit, grace seconds, set TTL seconds.
# Returns -1 when reserved, else the number of outstanding saves.
_RESERVE = """
local now = tonumber(redis.call('TIME')[1])
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local live = 0
for i = 1, #members, 2 do
  local id, since = members[i], tonumber(members[i + 1])
  local status = redis.call('HGET', ARGV[1] .. id, 'status')
  local ended
  if status then ended = status == 'completed' or status == 'failed' else ended = now - since > tonumber(ARGV[4]) end
  if ended then redis.call('ZREM', KEYS[1], id) else live = live + 1 end
end
if live >= tonumber(ARGV[3]) then return live end
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return -1
"""


async def submit_save(ctx: ApiContext, tenant: str, policy: TenantPolicy, record: ModelRecord, op: str,
                      payload: Any, seq_id: int | None = None) -> str:
    """Submit a checkpoint save of `record`: checked against the key's quotas, counted against its rate limits
    on its pool and against its outstanding saves."""
    await ctx.quotas.check(tenant, policy, op)
    request_id = new_request_id()
    if ctx.writes is not None:
        await ctx.writes.reserve(tenant, request_id)
    try:
        await ctx.limiter.admit(tenant, record.queue)
        winner = await ctx.store.submit(op=op, owner=tenant, model_id=record.model_id, queue=record.queue,
                                        payload=payload, seq_id=seq_id, request_id=request_id,
                                        weight=policy.weight)
    except BaseException:
        if ctx.writes is not None:
            await ctx.writes.release(tenant, request_id)
        raise
    if winner != request_id and ctx.writes is not None:  # a retried save: the first one is counted already
        await ctx.writes.release(tenant, request_id)
    return winner
