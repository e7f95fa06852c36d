"""Queued ops where the broker holds them, and failing them while they are still queued.

A queued op's message is in one of three places: its pool's broker queue (a Redis list, newest at the head, and
its handover list: popped by the pool's consumer, not yet recorded, workers/handover.py), delivered to its worker
and not acknowledged yet (kombu's `unacked` hash: the ops a worker holds, running or waiting for their turn), or
parked in its key's backlog (twinkle.backlog). The scripts here read request ids
out of those places on the Redis server, BATCH entries a call (a message is about a kilobyte of JSON, its id
30 bytes), optionally only ids created before a time (a request id starts with its creation time), so a scan
costs Redis about 6 us an entry and moves only ids.

Failing is one script per batch that writes only records still `queued`: a running or terminal record is never
overwritten (the worker that began the op first wins), and a later delivery of a failed op's message finds its
record terminal and is skipped (workers/runtime.py). Its long-polls wake at once (the done channel).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from twinkle.backlog import BacklogKeys, Parked
from twinkle.broker import UNACKED, handover_key
from twinkle.keys import Keys

BATCH = 500  # entries a script call reads or writes: a few ms of Redis at most
# Failing thousands of ops at once wakes thousands of long-polls at once, and an API process then answers them
# ahead of every other request (2,000 at once: other tenants' step p99 13x for 3 s, on 2 busy cores). Paced at
# WAKE_BATCH per WAKE_PAUSE (500 a second, what one API process answers there) 2,000 end as soon (4 s) and the
# others' p99 stays within 2x (bench/faults.py --frozen-backlog).
WAKE_BATCH = 50
WAKE_PAUSE = 0.1


@dataclass(frozen=True)
class Failure:
    """What failing an op writes on its record. `error` may name `{op}` and `{waited}` (whole seconds since it
    was accepted), filled in per record by the script."""

    error: str
    code: str
    category: str = "server"


def created_ms(request_id: str) -> int:
    """The creation time a request id starts with, in ms (0 when it has none: then only its record can tell)."""
    head, _, tail = request_id.partition("-")
    try:
        return int(head, 16) if tail and len(head) <= 12 else 0
    except ValueError:
        return 0


class QueuedOps:
    def __init__(self, r: Any, keys: Keys, *, ttl: int) -> None:
        self.r = r
        self.keys = keys
        self.backlog = BacklogKeys(keys)
        self.ttl = ttl  # a failed record lives as long as a finished one
        self._queue_ids = r.register_script(_QUEUE_IDS)
        self._held_ids = r.register_script(_HELD_IDS)
        self._fail = r.register_script(FAIL_QUEUED)
        self._unpark = r.register_script(_UNPARK)

    # -- where they are ----------------------------------------------------------------------------

    def in_queue(self, queue: str, *, created_before: float = 0.0) -> Iterator[list[str]]:
        """Batches of the request ids in the broker queue (and its handover list), oldest first; with
        `created_before` (epoch seconds) only ids created before it. Messages pushed or popped meanwhile may
        shift a batch: a periodic sweep sees them the next time."""
        before_ms = int(created_before * 1000)
        for key in (handover_key(queue), queue):
            length = int(self.r.llen(key))
            for end in range(-1, -length - 1, -BATCH):
                ids = self._queue_ids(keys=[key], args=[end - BATCH + 1, end, before_ms])
                yield [_text(i) for i in reversed(ids)]

    def held(self, queues: Iterable[str], *, created_before: float = 0.0) -> dict[str, list[str]]:
        """The request ids each of `queues` has in the unacked hash (delivered to its worker, not acknowledged)."""
        names = list(queues)
        out: dict[str, list[str]] = {name: [] for name in names}
        if not names:
            return out
        cursor = "0"
        while True:
            reply = self._held_ids(keys=[UNACKED], args=[cursor, BATCH, int(created_before * 1000), *names])
            cursor = _text(reply[0])
            for index, request_id in zip(reply[1::2], reply[2::2], strict=True):
                out[names[int(index) - 1]].append(_text(request_id))
            if cursor == "0":
                return out

    def parked(self, queue: str, tenant: str, *, created_before: float = 0.0) -> list[Parked]:
        """The key's parked ops, oldest first; with `created_before`, the ones at its head created before it (a
        backlog is in acceptance order, so the scan stops at the first younger one)."""
        key = self.backlog.parked(queue, tenant)
        before_ms = int(created_before * 1000)
        out: list[Parked] = []
        start = 0
        while True:
            items = [Parked.decode(raw) for raw in self.r.lrange(key, start, start + BATCH - 1)]
            for item in items:
                if before_ms and created_ms(item.request_id) >= before_ms:
                    return out
                out.append(item)
            if len(items) < BATCH:
                return out
            start += BATCH

    def waiting_tenants(self, queue: str) -> list[str]:
        return sorted(_text(m) for m in self.r.smembers(self.backlog.waiting(queue)))

    # -- failing them ------------------------------------------------------------------------------

    def fail(self, request_ids: list[str], failure: Failure, *, created_before: float = 0.0, model_id: str = "",
             batch: int = BATCH, pause: float = 0.0) -> list[str]:
        """Fail the records of `request_ids` that are still queued (and created before `created_before`, of
        `model_id`, when given) in one atomic step per `batch`, `pause` seconds apart; returns the ids failed."""
        failed: list[str] = []
        for start in range(0, len(request_ids), batch):
            if start and pause:
                time.sleep(pause)
            ids = request_ids[start:start + batch]
            keys, args = fail_arguments(self.keys, ids, failure, ttl=self.ttl, created_before=created_before,
                                        model_id=model_id)
            failed += [ids[int(p) - 1] for p in self._fail(keys=keys, args=args)]
        return failed

    def unpark(self, queue: str, tenant: str, request_ids: list[str]) -> int:
        """Take `request_ids` out of the key's backlog (their records ended): nothing sends them later. Returns
        how many were there."""
        removed = 0
        for start in range(0, len(request_ids), BATCH):
            removed += int(self._unpark(keys=[self.backlog.parked(queue, tenant), self.backlog.waiting(queue)],
                                        args=[tenant, *request_ids[start:start + BATCH]]))
        return removed


def fail_arguments(keys: Keys, request_ids: list[str], failure: Failure, *, ttl: int = 0, created_before: float = 0.0,
                   model_id: str = "") -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of FAIL_QUEUED for `request_ids` (for a caller with a client of its own, e.g. asyncio)."""
    return ([key for rid in request_ids for key in (keys.future(rid), keys.blob_in(rid))],
            [time.time(), ttl, created_before, model_id, failure.error, failure.category, failure.code,
             *[keys.done_channel(rid) for rid in request_ids]])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# A Celery message names its task id (the request id) as `"id": "..."` in its headers, the first `"id"` key of
# kombu's JSON; cjson decodes one that reads otherwise. `born` is a request id's creation time in ms.
_ID_OF = """
local function id_of(raw)
  local id = string.match(raw, '"id": "([^"]+)"')
  if id then return id end
  local ok, message = pcall(cjson.decode, raw)
  if not ok or type(message) ~= 'table' then return nil end
  if message[1] ~= nil then message = message[1] end
  if type(message) == 'table' and type(message.headers) == 'table' and type(message.headers.id) == 'string' then
    return message.headers.id
  end
  return nil
end
local function born(id)
  local head = string.match(id, '^(%x+)%-')
  if head and #head <= 12 then return tonumber(head, 16) end
  return 0
end
"""

# KEYS: a broker queue. ARGV: start, stop (LRANGE indexes), created before (ms, 0 = any). Returns request ids.
_QUEUE_IDS = _ID_OF + """
local before = tonumber(ARGV[3])
local out = {}
for _, raw in ipairs(redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])) do
  local id = id_of(raw)
  if id and (before == 0 or born(id) < before) then out[#out + 1] = id end
end
return out
"""

# KEYS: kombu's unacked hash. ARGV: HSCAN cursor, count, created before (ms, 0 = any), queue names. An entry is
# `[message, exchange, routing key]`. Returns the next cursor, then (1-based queue index, request id) pairs.
_HELD_IDS = _ID_OF + """
local wanted = {}
for i = 4, #ARGV do wanted[ARGV[i]] = i - 3 end
local before = tonumber(ARGV[3])
local reply = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local out = {reply[1]}
local entries = reply[2]
for i = 2, #entries, 2 do
  local raw = entries[i]
  local queue = string.match(raw, '"([^"]*)"%s*%]%s*$')
  local index = queue and wanted[queue]
  if index then
    local id = id_of(raw)
    if id and (before == 0 or born(id) < before) then
      out[#out + 1] = index
      out[#out + 1] = id
    end
  end
end
return out
"""

# KEYS: (future record, input blob) per op. ARGV: now, ttl (0 = the record keeps its own), created before (s,
# 0 = any), model id ('' = any), error, category, code, then each op's done channel. Fails only records still
# `queued`, as a worker's finish would (input blob deleted, record kept `ttl`), and wakes their long-polls.
# Returns the 1-based positions of the ops failed.
FAIL_QUEUED = """
local now, before, model = tonumber(ARGV[1]), tonumber(ARGV[3]), ARGV[4]
local out = {}
for i = 1, #KEYS / 2 do
  local record = KEYS[2 * i - 1]
  local fields = redis.call('HMGET', record, 'status', 'created_at', 'model_id', 'op')
  local created = tonumber(fields[2] or '0') or 0
  if fields[1] == 'queued' and (before == 0 or (created > 0 and created < before))
      and (model == '' or fields[3] == model) then
    local error = string.gsub(ARGV[5], '{op}', fields[4] or 'The op')
    error = string.gsub(error, '{waited}', string.format('%.0f', now - created))
    redis.call('HSET', record, 'status', 'failed', 'error', error, 'category', ARGV[6], 'code', ARGV[7],
               'finished_at', ARGV[1])
    if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', record, ARGV[2]) end
    redis.call('DEL', KEYS[2 * i])
    redis.call('PUBLISH', ARGV[7 + i], 'failed')
    out[#out + 1] = i
  end
end
return out
"""

# KEYS: a key's backlog list, the queue's waiting set. ARGV: tenant, request ids to take out. The list is rebuilt
# in one step (the API appends and pools pop meanwhile only between scripts).
_UNPARK = """
local drop = {}
for i = 2, #ARGV do drop[ARGV[i]] = true end
local kept, removed = {}, 0
for _, item in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if drop[string.match(item, '^(%S+)')] then removed = removed + 1 else kept[#kept + 1] = item end
end
if removed == 0 then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
for i = 1, #kept, 1000 do redis.call('RPUSH', KEYS[1], unpack(kept, i, math.min(i + 999, #kept))) end
if #kept == 0 then redis.call('SREM', KEYS[2], ARGV[1]) elseif ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return removed
"""
