"""Sample requests recorded for stable_reinforce: read back by request id, kept a day, each use restarting it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from api.stability_records import RECORD_TTL_SECONDS, StabilityRecords
from tests.harness import scratch_keys


@pytest.fixture
async def records() -> AsyncIterator[StabilityRecords]:
    async with scratch_keys() as (r, keys):
        yield StabilityRecords(r, keys)


async def test_a_recorded_sample_request_reads_back_and_expires_a_day_later(records: StabilityRecords) -> None:
    await records.record("r1", "alice", prompt_tokens=5, samples=2)
    found = await records.read(["r1", "r2"])
    assert found["r1"] == {b"owner": b"alice", b"prompt_tokens": b"5", b"samples": b"2"}
    assert found["r2"] == {}
    assert RECORD_TTL_SECONDS - 5 < await records.r.ttl(records.keys.stability("r1")) <= RECORD_TTL_SECONDS


async def test_renewing_a_record_restarts_its_day(records: StabilityRecords) -> None:
    await records.record("r1", "alice", prompt_tokens=5, samples=2)
    await records.r.expire(records.keys.stability("r1"), 10)
    await records.renew(["r1"])
    assert await records.r.ttl(records.keys.stability("r1")) > RECORD_TTL_SECONDS - 5
