"""The usage ledger as reports read it: the tenants it has seen, and a tenant's amounts per day or per detail."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
import redis

from api.usage_history import UsageHistory
from tests.harness import REDIS_HOST, REDIS_PORT, scratch_keys
from twinkle.futures import FutureRecord, Op
from twinkle.usage import UsageLedger

NOW = datetime(2025, 6, 30, 12, 0, tzinfo=UTC).timestamp()


@pytest.fixture
async def history() -> AsyncIterator[UsageHistory]:
    async with scratch_keys() as (r, keys):
        yield UsageHistory(r, keys)


async def test_a_recorded_op_shows_in_its_tenants_day_totals_and_details(history: UsageHistory) -> None:
    sync = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=2)
    record = FutureRecord(request_id="r1", op=Op.FORWARD_BACKWARD, owner="alice", model_id="run-1", queue="q")
    sync.hset(history.keys.keys.future("r1"), mapping=record.to_hash())  # the ledger meters existing futures only
    assert UsageLedger(sync, history.keys.keys).record(record, "tiny", {"trained_tokens": 7}, at=NOW)
    assert await history.tenants() == ["alice"]
    assert await history.per_day("alice", ["2025-06-29", "2025-06-30"], details=False) == [
        {}, {"trained_tokens": 7}]
    assert await history.per_day("alice", ["2025-06-30"], details=True) == [{"run-1|tiny|trained_tokens": 7}]
    sync.close()
