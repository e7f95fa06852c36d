"""Waiting for a future from any protocol (the Tinker long-poll, OpenAI's blocking and streaming answers)."""

from __future__ import annotations

from api.context import ApiContext
from api.long_poll import await_future
from twinkle.futures import FutureRecord


async def wait_for_future(ctx: ApiContext, record: FutureRecord, tenant: str, timeout: float) -> FutureRecord:
    """`record` once terminal or `timeout` passed (see `await_future`)."""
    if record.state.terminal or timeout <= 0:
        return record
    return await await_future(ctx, record.request_id, tenant, timeout)
