"""Each API key's share of a pool's broker queue: the rest of its ops wait in the key's own backlog.

A pool chooses its next op by fair share among the ops it holds (`scheduling.window`, workers/fair_share.py),
but a broker queue is a list served from its head: a key that submitted a thousand ops would put all of them
in front of everyone else's, out of the pool's sight. So the API sends a key's op to the broker queue only
while the key has fewer than its share there (the window divided among the keys with ops in it, at least
MIN_SHARE); past that the op is parked in the key's backlog list, in acceptance order. When one of the key's
ops finishes, its pool releases the key's next parked op into the queue, and the pool's heartbeat releases
what a missed release left behind (and forgets ops that ended elsewhere: a lost request, a hang).

Per pool queue `q` and key (tenant) `t`:
- `backlog:q:sent:t` sorted set: the key's ops in the broker queue or running, by the time they were sent;
- `backlog:q:parked:t` list: the key's parked ops, oldest first, each `<request id> <op> <model id>`;
- `backlog:q:keys` set: the keys with ops sent (their number divides the window);
- `backlog:q:waiting` set: the keys with parked ops (the heartbeat's round);
- `backlog:q:transit:t`: set while a pool sends the key's released ops, so that the API parks the key's new ops
  behind them instead of sending one ahead (it expires on its own should the pool die meanwhile).

A pool releases and sends under one lock, so its threads send a key's ops in backlog order.

A released op popped from the backlog whose message then never reached the broker (its pool died in between)
is found by the API's lost-request check (api/lost_futures.py) and fails `request_lost`, never waits forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twinkle.keys import Keys
from twinkle.script_batch import ScriptCall

MIN_SHARE = 2  # ops of each key in the queue at least, however many keys share the window


@dataclass(frozen=True)
class Parked:
    request_id: str
    op: str
    model_id: str

    def encode(self) -> str:
        return f"{self.request_id} {self.op} {self.model_id}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Parked:
        text = raw.decode() if isinstance(raw, bytes) else raw
        request_id, op, model_id = [*text.split(" ", 2), "", ""][:3]
        return cls(request_id, op, model_id)


@dataclass(frozen=True)
class BacklogKeys:
    keys: Keys

    def sent(self, queue: str, tenant: str) -> str:
        return f"{self.keys.root}backlog:{queue}:sent:{tenant}"

    def parked(self, queue: str, tenant: str) -> str:
        return f"{self.keys.root}backlog:{queue}:parked:{tenant}"

    def tenants(self, queue: str) -> str:
        return f"{self.keys.root}backlog:{queue}:keys"

    def waiting(self, queue: str) -> str:
        return f"{self.keys.root}backlog:{queue}:waiting"

    def transit(self, queue: str, tenant: str) -> str:
        return f"{self.keys.root}backlog:{queue}:transit:{tenant}"

    def of(self, queue: str, tenant: str) -> list[str]:
        """KEYS of the admit and release scripts."""
        return [self.sent(queue, tenant), self.parked(queue, tenant), self.tenants(queue), self.waiting(queue),
                self.transit(queue, tenant)]


class BacklogRelease:
    """The pools' side: take a finished op off its key's count and release the key's next parked ops."""

    def __init__(self, r: Any, keys: Keys, queue: str, window: int, ttl: int) -> None:
        self.r = r
        self.keys = BacklogKeys(keys)
        self.future_keys = keys
        self.queue = queue
        self.window = window  # the pool's scheduling.window: the keys' shares of the queue add up to it
        self.ttl = ttl
        self._release = r.register_script(RELEASE)
        self.lock = threading.Lock()

    def finished(self, tenant: str, request_id: str, send: Callable[[Parked], None]) -> int:
        """`request_id` of `tenant` ended ('' = none): send the key's parked ops that may enter the queue now,
        in order, with `send`. An op `send` fails on goes back to the head of the backlog with the ones after it.
        Returns how many were sent."""
        with self.lock:
            return self.dispatch(tenant, self.run_release(self.release_call(tenant, request_id)), send)

    def release_call(self, tenant: str, request_id: str) -> ScriptCall:
        """The release script's call for `request_id` of `tenant` ('' = none), to be sent along with other writes
        (twinkle.script_batch) under `lock`; its reply goes to `dispatch`, still under the lock, so that
        the pool's threads send each key's ops in backlog order."""
        return ScriptCall(self._release, self.keys.of(self.queue, tenant),
                          [tenant, request_id, self.window, MIN_SHARE, self.ttl, time.time()])

    def run_release(self, call: ScriptCall) -> Any:
        return self._release(keys=call.keys, args=call.args)

    def dispatch(self, tenant: str, reply: Any, send: Callable[[Parked], None]) -> int:
        """Send the ops a release call's `reply` released, and then whatever more may follow them. Under `lock`.
        A reply that is an error (the release failed in its batch, twinkle.script_batch) is raised."""
        if isinstance(reply, Exception):
            raise reply
        count = 0
        while True:
            released = [Parked.decode(item) for item in reply]
            for index, parked in enumerate(released):
                try:
                    send(parked)
                except Exception:
                    self._unsend(tenant, released[index:])
                    raise
                count += 1
            if not released:  # and so no transit mark was set (RELEASE sets it only with what it releases)
                return count
            # ops the API parked while these were in transit may fit now too
            self.r.delete(self.keys.transit(self.queue, tenant))
            reply = self.run_release(self.release_call(tenant, ""))

    def put_back(self, tenant: str, reply: Any) -> None:
        """The ops a release call's `reply` released go back to the head of the key's backlog, unsent (the pool may
        no longer send: another worker took its queue). Under `lock`."""
        released = [Parked.decode(item) for item in reply]
        if released:
            self._unsend(tenant, released)

    def _unsend(self, tenant: str, parked: list[Parked]) -> None:
        """Released ops whose messages could not be sent go back to the head of the key's backlog, in order."""
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(self.keys.sent(self.queue, tenant), *[p.request_id for p in parked])
        pipe.lpush(self.keys.parked(self.queue, tenant), *[p.encode() for p in reversed(parked)])
        pipe.sadd(self.keys.waiting(self.queue), tenant)
        pipe.delete(self.keys.transit(self.queue, tenant))
        pipe.execute()

    def sweep(self, send: Callable[[Parked], None]) -> int:
        """Forget sent ops of waiting keys that ended elsewhere, and send what there is room for."""
        count = 0
        for member in self.r.smembers(self.keys.waiting(self.queue)):
            tenant = member.decode() if isinstance(member, bytes) else str(member)
            sent = [m.decode() if isinstance(m, bytes) else str(m)
                    for m in self.r.zrange(self.keys.sent(self.queue, tenant), 0, -1)]
            pipe = self.r.pipeline(transaction=False)
            for request_id in sent:
                pipe.hget(self.future_keys.future(request_id), "status")
            ended = [rid for rid, status in zip(sent, pipe.execute(), strict=True)
                     if status is None or status in (b"completed", b"failed")]
            if ended:
                self.r.zrem(self.keys.sent(self.queue, tenant), *ended)
            count += self.finished(tenant, "", send)
        return count


# KEYS: sent, parked, keys, waiting, transit. ARGV: tenant, request id, op, model id, window (0 = no backlog),
# min share, ttl, now. Returns 1 when the op goes to the broker now, 0 when it was parked.
ADMIT = """
local sent, parked, keys, waiting, transit = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local window = tonumber(ARGV[5])
if window <= 0 then return 1 end
local share = math.max(tonumber(ARGV[6]), math.floor(window / math.max(1, redis.call('SCARD', keys))))
if redis.call('LLEN', parked) == 0 and redis.call('EXISTS', transit) == 0 and redis.call('ZCARD', sent) < share then
  redis.call('ZADD', sent, ARGV[8], ARGV[2])
  redis.call('EXPIRE', sent, ARGV[7])
  redis.call('SADD', keys, ARGV[1])
  return 1
end
redis.call('RPUSH', parked, ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4])
redis.call('EXPIRE', parked, ARGV[7])
redis.call('SADD', waiting, ARGV[1])
return 0
"""

# KEYS: sent, parked, keys, waiting, transit. ARGV: tenant, finished request id ('' = none), window, min share,
# ttl, now. Returns the released items, oldest first.
RELEASE = """
local sent, parked, keys, waiting, transit = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if ARGV[2] ~= '' then redis.call('ZREM', sent, ARGV[2]) end
local share = math.max(tonumber(ARGV[4]), math.floor(tonumber(ARGV[3]) / math.max(1, redis.call('SCARD', keys))))
local out = {}
while redis.call('ZCARD', sent) < share do
  local item = redis.call('LPOP', parked)
  if not item then break end
  redis.call('ZADD', sent, ARGV[6], string.match(item, '^(%S+)'))
  out[#out + 1] = item
end
if redis.call('ZCARD', sent) == 0 then redis.call('SREM', keys, ARGV[1]) else
  redis.call('SADD', keys, ARGV[1])
  redis.call('EXPIRE', sent, ARGV[5])
end
if redis.call('LLEN', parked) == 0 then redis.call('SREM', waiting, ARGV[1]) end
if #out > 0 then redis.call('SET', transit, '1', 'EX', 10) end
return out
"""
