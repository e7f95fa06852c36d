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
import json
import time

import redis.asyncio as aioredis

from twinkle.backlog import BacklogKeys
from twinkle.broker import UNACKED, handover_key
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.queue_timeouts import MARGIN_SECONDS, queue_timeout_error
from twinkle.queued_ops import FAIL_QUEUED, Failure, fail_arguments

RECHECK_SECONDS = 0.5
LOST_ERROR = ("The server's queue (Redis) restarted and lost this request before it ran. Submit it again; "
              "the model's state is unchanged by it.")


class LostFutures:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self._fail_script = r.register_script(_FAIL_IF_UNCHANGED)
        self._fail_queued = r.register_script(FAIL_QUEUED)
        self.queue_timeouts: dict[str, float] = {}  # pool queue -> its queue_timeout (absent or 0: forever)

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
            raw_beat = await self.r.get(self.keys.pool_heartbeat(record.queue))
            since = float(json.loads(raw_beat).get("since", 0)) if raw_beat else 0.0
            if not since or record.created_at >= since:
                return record  # its worker was already running when it was submitted
            broker_run_id = record.broker_run_id or broker_run_id
            broker_started_at = max(broker_started_at, since)
        for attempt in range(2):
            found = await self._message_found(record, broker_started_at)
            if found is None:
                return record  # cannot tell yet (the pool is restarting); ask again on the next poll
            if found:
                await self.r.eval(_ADOPT, 1, self.keys.future(record.request_id), broker_run_id)
                return record
            if attempt == 0:
                await asyncio.sleep(RECHECK_SECONDS)
                raw = await self.r.hgetall(self.keys.future(record.request_id))
                if not raw:
                    return record
                fresh = FutureRecord.from_hash(raw)
                if fresh.status != record.status:
                    return fresh  # it moved on (a worker took it, or it finished)
        return await self._fail(record)

    def _past_queue_timeout(self, record: FutureRecord) -> bool:
        timeout = self.queue_timeouts.get(record.queue, 0.0)
        return timeout > 0 and record.created_at > 0 and time.time() - record.created_at > timeout + MARGIN_SECONDS

    async def _time_out(self, record: FutureRecord) -> FutureRecord:
        timeout = self.queue_timeouts[record.queue]
        error = queue_timeout_error("{op}", "{waited}", record.queue, timeout)  # filled in by the script
        keys, args = fail_arguments(self.keys, [record.request_id], Failure(str(error), error.code, error.category),
                                    created_before=time.time() - timeout - MARGIN_SECONDS)
        await self._fail_queued(keys=keys, args=args)
        raw = await self.r.hgetall(self.keys.future(record.request_id))
        return FutureRecord.from_hash(raw) if raw else record

    async def _message_found(self, record: FutureRecord, broker_started_at: float = 0.0) -> bool | None:
        needle = record.request_id.encode()
        queued = []
        if record.state is FutureStatus.QUEUED:  # in its queue, or popped and not yet recorded (workers/handover.py)
            queued = [*await self.r.lrange(record.queue, 0, -1),
                      *await self.r.lrange(handover_key(record.queue), 0, -1)]
        if any(needle in raw for raw in queued):
            return True
        if record.state is FutureStatus.QUEUED:  # parked in its key's backlog, not yet sent (twinkle.backlog)
            parked: list[bytes] = await self.r.lrange(  # type: ignore[assignment]
                BacklogKeys(self.keys).parked(record.queue, record.owner), 0, -1)
            if any(raw.startswith(needle + b" ") for raw in parked):
                return True
            # waiting out a full-parameter run's hold of the pool (twinkle.pool_reservation)
            if await self.r.lpos(self.keys.reservation_parked_ids(record.queue), record.request_id) is not None:
                return True
        if any(needle in raw for raw in await self.r.hvals(UNACKED)):
            return True
        if record.state is FutureStatus.RUNNING:
            raw_beat = await self.r.get(self.keys.pool_heartbeat(record.queue))
            beat = json.loads(raw_beat) if raw_beat else {}
            if float(beat.get("t", 0)) <= record.started_at:
                return None  # no heartbeat since the op started: its worker may not have reported it yet
            # a clock cycle runs several ops at once; `current` names one, `held` all of them
            return beat.get("current") == record.request_id or record.request_id in beat.get("held", ())
        if broker_started_at:
            raw_beat = await self.r.get(self.keys.pool_heartbeat(record.queue))
            beat = json.loads(raw_beat) if raw_beat else {}
            if float(beat.get("t", 0)) <= broker_started_at:
                return None  # its worker has not reported to this broker yet: it may hold the message
            return record.request_id in beat.get("held", ())
        return False

    async def _fail(self, record: FutureRecord) -> FutureRecord:
        now = time.time()
        key = self.keys.future(record.request_id)
        failed = await self._fail_script(
            keys=[key], args=[record.status, record.broker_run_id, now, LOST_ERROR, self.keys.done_channel(
                record.request_id)])
        if not failed:
            raw = await self.r.hgetall(key)
            return FutureRecord.from_hash(raw) if raw else record
        record.status, record.error, record.finished_at = FutureStatus.FAILED, LOST_ERROR, now
        record.category, record.code = "server", "request_lost"
        return record


# KEYS: future. ARGV: broker run_id. Only an existing record adopts it (never create a partial hash).
_ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'broker_run_id', ARGV[1]) end
return 1
"""

# KEYS: future. ARGV: expected status, expected run_id, now, error, done channel.
_FAIL_IF_UNCHANGED = """
local current = redis.call('HMGET', KEYS[1], 'status', 'broker_run_id')
if current[1] ~= ARGV[1] or current[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[4], 'category', 'server',
           'code', 'request_lost', 'finished_at', ARGV[3])
redis.call('PUBLISH', ARGV[5], 'failed')
return 1
"""
