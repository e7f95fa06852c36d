"""Futures from any protocol: waiting for one (the Tinker long-poll, OpenAI's blocking and streaming answers), and
why one still waits."""

from __future__ import annotations

from api.context import ApiContext
from api.long_poll import await_future
from api.slots import waiting_for_slot
from twinkle.futures import FutureRecord, FutureStatus


async def wait_for_future(ctx: ApiContext, record: FutureRecord, tenant: str, timeout: float) -> FutureRecord:
    """`record` once terminal or `timeout` passed (see `await_future`)."""
    if record.state.terminal or timeout <= 0:
        return record
    return await await_future(ctx, record.request_id, tenant, timeout)


async def waiting_state(ctx: ApiContext, record: FutureRecord) -> tuple[str, str]:
    """(queue state, reason) of a future not done yet: `active` while it runs or queues, `paused_rate_limit` while
    its key is over a rate limit on its pool, `paused_capacity` while the pool is reserved by a full-parameter run
    or every LoRA slot holds another adapter."""
    if record.state is FutureStatus.RUNNING:
        reason = f"running on {record.queue}"
    else:
        position = await ctx.store.queue_position(record)
        reason = f"queued on {record.queue}, {position} ahead"
    throttled = await ctx.limiter.over_limit(record.owner, record.queue)
    if throttled:
        return "paused_rate_limit", f"{throttled}; this request is {reason}"
    if record.queue in ctx.catalog.reserving_queues and (
            reserved := await ctx.pools.reservation_wait(record)) is not None:
        return "paused_capacity", reserved
    if (waiting := await waiting_for_slot(ctx, record)) is not None:
        return "paused_capacity", f"{waiting}; this request is {reason}"
    return "active", reason
