"""Every Lua script that moves a future or reads where its broker message is, run on the Redis server.

Each comment names the script's KEYS and ARGV; the call that fills them in is in the ledger's other modules
(`lifecycle`, `queued`, `saves`, `messages`), where its reply is decoded too.
"""

from __future__ import annotations

from twinkle.backlog import ADMIT

# One round trip per submit: dedupe on (scope, seq_id), take a queue ticket, store the payload and the
# future record, and list it among its owner's latest 200 requests (the console's op list).
# A re-sent script (redis-py sends it once more when the reply was lost) finds its future and changes nothing.
# KEYS: dedupe (or any key when there is no seq_id), tickets, future, blob_in, model ("" = none), owner's futures.
# ARGV: request_id, ttl, payload, now, has_dedupe, the model's owner to check ('' = no check), then the record's
# field/value pairs. With an owner to check, a model that is not that owner's active one takes nothing and answers
# '!missing' (none, or another owner's) or '!unloaded': the API keeps a model's unchanging fields and leaves its
# status, which changes, to this check at the moment of the submit.
SUBMIT = """
if ARGV[6] ~= '' then
  local model = redis.call('HMGET', KEYS[5], 'owner', 'status')
  if model[1] ~= ARGV[6] then return '!missing' end
  if model[2] ~= 'active' then return '!unloaded' end
end
if redis.call('EXISTS', KEYS[3]) == 1 then return ARGV[1] end
if ARGV[5] == '1' then
  local previous = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2], 'GET')
  if previous then return previous end
end
local ticket = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[4], ARGV[3], 'EX', ARGV[2])
redis.call('HSET', KEYS[3], unpack(ARGV, 7))
redis.call('HSET', KEYS[3], 'ticket', ticket)
redis.call('EXPIRE', KEYS[3], ARGV[2])
if KEYS[5] ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then redis.call('HSET', KEYS[5], 'last_request_at', ARGV[4]) end
redis.call('ZADD', KEYS[6], ARGV[4], ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[6], 0, -201)
redis.call('EXPIRE', KEYS[6], ARGV[2])
return ARGV[1]
"""

# The submit, the key's admission (twinkle.backlog) and the op's broker message in one script: the record and the
# message are written together or not at all, and a retried submit (the dedupe's winner) sends nothing again.
# KEYS: SUBMIT's six, ADMIT's five, the pool's queue list. ARGV: how many of SUBMIT's arguments come first,
# those, ADMIT's eight, the message (twinkle.task_message). Returns SUBMIT's answer.
SUBMIT_AND_SEND = f"""
local function submit(KEYS, ARGV)
{SUBMIT}
end
local function admit(KEYS, ARGV)
{ADMIT}
end
local n = tonumber(ARGV[1])
local submit_args = {{unpack(ARGV, 2, n + 1)}}
-- the same script again (redis-py re-sends it once when the reply was lost): its op is stored and sent already
if redis.call('EXISTS', KEYS[3]) == 1 then return submit_args[1] end
local winner = submit({{unpack(KEYS, 1, 6)}}, submit_args)
if winner ~= submit_args[1] then return winner end
if admit({{unpack(KEYS, 7, 11)}}, {{unpack(ARGV, n + 2, n + 9)}}) == 1 then
  redis.call('LPUSH', KEYS[12], ARGV[n + 10])
end
return winner
"""


def _writing_as_holder(*, token: int, vanished: int) -> str:
    """The opening of a pool's write to a future (KEYS[1]): -2 when the pool's lease fence (KEYS[4], '' = none)
    names another worker than the lease token ARGV[`token`], `vanished` when the record is gone."""
    return f"""
if KEYS[4] ~= '' then
  local fence = redis.call('GET', KEYS[4])
  if fence and fence ~= ARGV[{token}] then return -2 end
end
if redis.call('EXISTS', KEYS[1]) == 0 then return {vanished} end"""


# KEYS: future, model ("" = none), queue_started, fence ('' = none). ARGV: now, ticket, lease token, attempt id
# (the same attempt sent again, after a reply the broker lost, returns the index it got the first time). A worker
# whose pool lease another worker took since (the fence names another token) writes nothing: -2; a missing fence
# (a broker restarted without persistence) fences nobody off. A vanished record: -1. An op that already ended
# (a sweep failed it while the pool held it) is never begun: -3.
BEGIN = _writing_as_holder(token=3, vanished=-1) + """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'completed' or status == 'failed' then return -3 end
if redis.call('HGET', KEYS[1], 'begun_by') == ARGV[4] then
  return tonumber(redis.call('HGET', KEYS[1], 'exec_index') or '0')
end
local index = 0
if KEYS[2] ~= '' and redis.call('EXISTS', KEYS[2]) == 1 then
  index = redis.call('HINCRBY', KEYS[2], 'ops_executed', 1)
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'exec_index', index, 'begun_by', ARGV[4])
local current = tonumber(redis.call('GET', KEYS[3]) or '0')
if current < tonumber(ARGV[2]) then redis.call('SET', KEYS[3], ARGV[2]) end
return index
"""

# KEYS: future, blob_out, blob_in, fence ('' = none), kombu's unacked hash and index. ARGV: ttl, result blob ('' =
# none), done channel, status, lease token, delivery tag ('' = none), '1' to send the result with the done message
# (else the status alone), field/value pairs. Fenced off as BEGIN is: -2; a vanished record: 0; written: 1, and then
# the op's message, named by its delivery tag, is acknowledged as kombu's ack does it (its unacked entry removed),
# so the outcome and the ack are one write.
FINISH = _writing_as_holder(token=5, vanished=0) + """
if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[1]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[3])
if ARGV[7] == '1' then
  redis.call('PUBLISH', ARGV[3], ARGV[4] .. '\\n' .. ARGV[2])
else
  redis.call('PUBLISH', ARGV[3], ARGV[4])
end
if ARGV[6] ~= '' then
  redis.call('HDEL', KEYS[5], ARGV[6])
  redis.call('ZREM', KEYS[6], ARGV[6])
end
return 1
"""

# KEYS: future. ARGV: now, error, code, done channel. Never creates a record, never overwrites an outcome.
FAIL_IF_PENDING = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[2], 'category', 'server', 'code', ARGV[3],
           'finished_at', ARGV[1])
redis.call('PUBLISH', ARGV[4], 'failed')
return 1
"""

# KEYS: future. ARGV: broker run_id. Only an existing record adopts it (never create a partial hash).
ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'broker_run_id', ARGV[1]) end
return 1
"""

# KEYS: future. ARGV: expected status, expected run_id, now, error, done channel.
FAIL_IF_UNCHANGED = """
local current = redis.call('HMGET', KEYS[1], 'status', 'broker_run_id')
if current[1] ~= ARGV[1] or current[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[4], 'category', 'server',
           'code', 'request_lost', 'finished_at', ARGV[3])
redis.call('PUBLISH', ARGV[5], 'failed')
return 1
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
UNPARK = """
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

# KEYS: future records. ARGV: the broker's run_id now, then the terminal statuses. Returns the (1-based) positions
# of the records that ended, vanished, or were written under another broker run.
TO_WAKE = """
local woken = {}
for i, key in ipairs(KEYS) do
  local fields = redis.call('HMGET', key, 'status', 'broker_run_id')
  local status, run = fields[1], fields[2]
  if not status or status == ARGV[2] or status == ARGV[3]
      or (run and run ~= '' and ARGV[1] ~= '' and run ~= ARGV[1]) then
    woken[#woken + 1] = i
  end
end
return woken
"""

# KEYS: the owner's set. ARGV: future key prefix, request id, limit, grace seconds, set TTL seconds.
# Returns -1 when reserved, else the number of outstanding saves.
RESERVE_SAVE = """
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
QUEUE_IDS = _ID_OF + """
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
HELD_IDS = _ID_OF + """
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

# KEYS: handover list, queue. Moves what a pool's consumer popped but never recorded as unacked back to the
# head of its queue (the end BLMOVE/BRPOP take from), oldest at the very head; returns how many.
RETURN_HANDOVER = """
local moved = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT') do moved = moved + 1 end
return moved
"""

# KEYS: unacked index, unacked hash, handover list, queue. ARGV: delivery tag, now, unacked entry, handed-over item.
# Answers how many messages wait in the queue behind it.
RECORD_DELIVERY = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('LREM', KEYS[3], 1, ARGV[4])
return redis.call('LLEN', KEYS[4])
"""

# KEYS: unacked, unacked_index, queue, pool lease fence ('' = none). ARGV: tag, message, lease token. Atomic, and
# a no-op when it was acked meanwhile or another worker took the queue's lease.
RESTORE_ORPHAN = """
if KEYS[4] ~= '' then
  local fence = redis.call('GET', KEYS[4])
  if fence and fence ~= ARGV[3] then return 0 end
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: model, its run metrics list, the op's future. ARGV: steps (1/0), entry, max entries, the op's finished_at
# ('' = unchecked). Appends `<step> <entry>` to the run's capped list, counting an optimizer step in the model
# record; with a finished_at, only where the op's record says it finished then (its finish was written by the
# worker that sends this along with it). Returns the step, -1 when the model is gone, -2 when the finish is not
# this one.
APPEND_RUN_METRICS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[3], 'finished_at') ~= ARGV[4] then return -2 end
local step
if ARGV[1] == '1' then
  step = redis.call('HINCRBY', KEYS[1], 'steps', 1)
else
  step = tonumber(redis.call('HGET', KEYS[1], 'steps') or '0') + 1
end
redis.call('RPUSH', KEYS[2], step .. ' ' .. ARGV[2])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[3]), -1)
return step
"""
