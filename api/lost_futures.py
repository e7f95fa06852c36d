"""Futures whose message the broker lost in a restart end `failed` instead of waiting forever.

Every future record carries the Redis `run_id` of the broker it was submitted to. A record whose run_id differs from
the broker's current one survived a broker restart (AOF, RDB, a restored snapshot) but its queued message may not
have. The message is looked for where it can be: in its pool queue, parked in its key's backlog (twinkle.backlog) or
behind a full-parameter run (twinkle.pool_reservation), or delivered and unacknowledged (kombu's `unacked` hash);
for a running op, also in the pool's heartbeat, which names the op its worker is executing. Found: the record adopts
the new run_id and is never checked again. Not found twice, half a second apart (the gap between a worker's BRPOP
and its unacked write): the record is failed, once, atomically, so that a waiting long-poll wakes up. A record that
vanished with the broker is the Store's concern (its id's timestamp predates the broker's start).

A queued record past its queue's queue_timeout (`queue_timeouts`) fails with code `queue_timeout` when read,
as the API's sweep would (twinkle.queue_timeouts): that also covers a message no place holds any more (a frozen
worker's consumer popped it into its socket) while its worker is not yet replaced.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.ledger import AsyncLedger, lifecycle, messages, queued
from twinkle.queue_timeouts import MARGIN_SECONDS, queue_timeout_error

RECHECK_SECONDS = 0.5
# How long a pool's worker start time, read from its heartbeat, is reused: every poll of a queued op asks it, and
# a restart is seen this much later at most (a parked poll's record is read again on the hub's re-read anyway).
WORKER_START_REUSE_SECONDS = 0.5
LOST_ERROR = ("The server's queue (Redis) restarted and lost this request before it ran. Submit it again; "
              "the model's state is unchanged by it.")


class LostFutures:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.ledger = AsyncLedger(r)
        self.keys = keys
        self.queue_timeouts: dict[str, float] = {}  # pool queue -> its queue_timeout (absent or 0: forever)
        self._worker_starts: dict[str, tuple[float, float]] = {}  # pool queue -> (its worker's start, read at)

    async def check(self, record: FutureRecord, broker_run_id: str, *, broker_started_at: float = 0.0
                    ) -> FutureRecord:
        """The record as it should be seen: unchanged, adopted by the current broker, or failed as lost.

        `broker_started_at`, when known, lets a queued message its worker holds in memory (delivered just
        before the broker went away, so in no queue and no unacked hash) count as surviving: the pool's
        heartbeat written since then names every message it holds.

        A queued record whose pool worker restarted after it was submitted is checked the same way: a worker
        killed or frozen between popping a message and recording it as unacked took the message with it."""
        if record.state.terminal:
            return record
        if record.state is FutureStatus.QUEUED and self._past_queue_timeout(record):
            return await self._time_out(record)
        if not record.broker_run_id or not broker_run_id or record.broker_run_id == broker_run_id:
            if record.state is not FutureStatus.QUEUED:
                return record
            since = await self._worker_start(record.queue)
            if not since or record.created_at >= since:
                return record  # its worker was already running when it was submitted
            broker_run_id = record.broker_run_id or broker_run_id
            broker_started_at = max(broker_started_at, since)
        for attempt in range(2):
            found = await self._message_found(record, broker_started_at)
            if found is None:
                return record  # cannot tell yet (the pool is restarting); ask again on the next poll
            if found:
                await self.ledger.run(lifecycle.adopt(self.keys, record.request_id, broker_run_id))
                return record
            if attempt == 0:
                await asyncio.sleep(RECHECK_SECONDS)
                fresh = await self.ledger.run(lifecycle.read(self.keys, record.request_id))
                if fresh is None:
                    return record
                if fresh.status != record.status:
                    return fresh  # it moved on (a worker took it, or it finished)
        return await self._fail(record)

    async def _worker_start(self, queue: str) -> float:
        """When the pool worker of `queue` started (0: no heartbeat), read at most every
        WORKER_START_REUSE_SECONDS."""
        known = self._worker_starts.get(queue)
        if known is not None and time.monotonic() - known[1] < WORKER_START_REUSE_SECONDS:
            return known[0]
        since = float((await self.ledger.run(messages.heartbeat(self.keys, queue))).get("since", 0))
        self._worker_starts[queue] = (since, time.monotonic())
        return since

    def _past_queue_timeout(self, record: FutureRecord) -> bool:
        timeout = self.queue_timeouts.get(record.queue, 0.0)
        return timeout > 0 and record.created_at > 0 and time.time() - record.created_at > timeout + MARGIN_SECONDS

    async def _time_out(self, record: FutureRecord) -> FutureRecord:
        timeout = self.queue_timeouts[record.queue]
        error = queue_timeout_error("{op}", "{waited}", record.queue, timeout)  # filled in by the script
        await self.ledger.run(queued.fail_queued(self.keys, [record.request_id], error=str(error), code=error.code,
                                                 category=error.category,
                                                 created_before=time.time() - timeout - MARGIN_SECONDS))
        return await self.ledger.run(lifecycle.read(self.keys, record.request_id)) or record

    async def _message_found(self, record: FutureRecord, broker_started_at: float = 0.0) -> bool | None:
        # queued: in its queue, popped and not yet recorded (workers/handover.py), parked in its key's backlog
        # (twinkle.backlog) or behind a full-parameter run's hold of the pool (twinkle.pool_reservation); or delivered
        seen = await self.ledger.run(messages.sighting(self.keys, record))
        if seen.waiting or seen.delivered:
            return True
        beat = seen.beat
        if record.state is FutureStatus.RUNNING:
            if float(beat.get("t", 0)) <= record.started_at:
                return None  # no heartbeat since the op started: its worker may not have reported it yet
            # a clock cycle runs several ops at once; `current` names one, `held` all of them
            return beat.get("current") == record.request_id or record.request_id in beat.get("held", ())
        if broker_started_at:
            if float(beat.get("t", 0)) <= broker_started_at:
                return None  # its worker has not reported to this broker yet: it may hold the message
            return record.request_id in beat.get("held", ())
        return False

    async def _fail(self, record: FutureRecord) -> FutureRecord:
        now = time.time()
        if not await self.ledger.run(lifecycle.fail_if_unchanged(self.keys, record, LOST_ERROR, now)):
            return await self.ledger.run(lifecycle.read(self.keys, record.request_id)) or record
        record.status, record.error, record.finished_at = FutureStatus.FAILED, LOST_ERROR, now
        record.category, record.code = "server", "request_lost"
        return record

