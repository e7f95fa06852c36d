"""A model pool held exclusively by one full-parameter run (`full_finetune` in a model application's args).

A full run trains the base model's own weights, so while it lives no LoRA adapter of its pool can run: their
adapters sit on the weights it changes. The pool worker takes the reservation when it creates the run, in queue
order, and holds it until the run is unloaded, its lease runs out (no op and no session heartbeat for
`lease_seconds`), its `max_hold_seconds` pass, or an operator ends it (`twinkle-server reservation end`).

While it is held, the pool parks every other run's op it is handed: the op's broker message goes to the pool's
parked list and its future stays `queued`, its poll naming the reservation, its end and the op's place among the
parked ones. Ending the reservation puts the parked messages back at the head of the queue, oldest first, in the
same script that deletes it, so no op is lost or sent twice. A pool that refuses instead (`while_reserved:
refuse`) fails those ops with `PoolReserved`, and the API refuses them at submit.

The record is a hash at `Keys.pool_reservation(queue)`: holder (model id), owner, session_id, since, expires_at,
max_until (0 = no cap), lease_seconds, ended (why an operator or the API ended it; "" while it runs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from twinkle.errors import PoolReserved
from twinkle.futures import FutureRecord
from twinkle.keys import Keys

log = logging.getLogger("twinkle.reservation")
RENEW_EVERY_SECONDS = 1.0  # an op of the holding run renews the lease at most this often


@dataclass(frozen=True)
class Reservation:
    holder: str
    owner: str
    session_id: str
    since: float
    expires_at: float
    max_until: float
    lease_seconds: float
    ended: str

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> Reservation | None:
        if not raw:
            return None
        text = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in raw.items()}
        return cls(holder=text.get("holder", ""), owner=text.get("owner", ""), session_id=text.get("session_id", ""),
                   since=float(text.get("since") or 0), expires_at=float(text.get("expires_at") or 0),
                   max_until=float(text.get("max_until") or 0), lease_seconds=float(text.get("lease_seconds") or 0),
                   ended=text.get("ended", ""))

    @property
    def until(self) -> float:
        """When it ends at the latest, unless renewed."""
        return min(self.expires_at, self.max_until) if self.max_until else self.expires_at

    def over(self, now: float | None = None) -> str:
        """Why the reservation is over ("" while it holds)."""
        now = time.time() if now is None else now
        if self.ended:
            return self.ended
        if self.max_until and now >= self.max_until:
            return "it reached the pool's max_hold_seconds"
        if now >= self.expires_at:
            return f"no op and no session heartbeat came for {self.lease_seconds:g} s"
        return ""

    def refusal(self, queue: str) -> PoolReserved:
        return PoolReserved(
            f"Pool {queue} is reserved by a full-parameter run until {_clock(self.until)} "
            f"(renewed while that run is active).",
            hint="Retry after that time, or ask the operator for another pool.",
            holder=self.holder, until=self.until)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


class PoolReservation:
    """One model pool worker's side of its reservation. `holder` is the run it holds the pool for; it changes only
    under the pool's lock (in an op's handler, or in `tick`), so a check of it under that lock is exact."""

    def __init__(self, r: redis.Redis, keys: Keys, queue: str, *, lease_seconds: float, max_hold_seconds: float = 0,
                 refuse: bool = False) -> None:
        self.r = r
        self.keys = keys
        self.queue = queue
        self.lease_seconds = lease_seconds
        self.max_hold_seconds = max_hold_seconds
        self.refuse = refuse
        self.holder: str | None = None
        self.message_for: Callable[[str, str, str], str] | None = None  # (op, request_id, model_id) -> message
        self.end_run: Callable[[str, str], None] | None = None  # (model id, why) ends the run on the backend
        self._renewed = 0.0
        self._take = r.register_script(_TAKE)
        self._park = r.register_script(_PARK)
        self._release = r.register_script(_RELEASE)

    @property
    def key(self) -> str:
        return self.keys.pool_reservation(self.queue)

    def read(self) -> Reservation | None:
        return Reservation.from_hash(self.r.hgetall(self.key))

    def take(self, rec: FutureRecord, session_id: str) -> None:
        """Hold the pool for `rec`'s run from now (its create or create-via-load is running)."""
        now = time.time()
        taken = self._take(keys=[self.key], args=[
            rec.model_id, now, self.lease_seconds, now + self.max_hold_seconds if self.max_hold_seconds else 0,
            rec.owner, session_id])
        if not int(taken):
            held = self.read()
            raise held.refusal(self.queue) if held else PoolReserved(f"Pool {self.queue} is reserved.")
        self.holder = rec.model_id
        self._renewed = time.monotonic()

    def renew(self, model_id: str) -> None:
        """An op of the holding run: its lease starts again (at most once a second)."""
        if model_id != self.holder or time.monotonic() - self._renewed < RENEW_EVERY_SECONDS:
            return
        renew(self.r, self.keys, self.queue, model_id)
        self._renewed = time.monotonic()

    def diverts(self, rec: FutureRecord) -> bool:
        """Whether `rec` is not the holding run's own op: it must not run now. Ops of no run wait too: a sample of
        a sampler checkpoint on a pool without a sampler pool generates with the weights the full run changed."""
        return self.holder is not None and rec.model_id != self.holder

    def park(self, op: str, rec: FutureRecord) -> bool:
        """Park the op's message until the reservation ends. False when it ended meanwhile: run the op now."""
        assert self.message_for is not None, "a pool that reserves builds its parked ops' messages"
        if self.refuse:
            held = self.read()
            if held is not None:
                raise held.refusal(self.queue)
            return False
        message = self.message_for(op, rec.request_id, rec.model_id)
        keys = [self.key, self.keys.reservation_parked(self.queue), self.keys.reservation_parked_ids(self.queue),
                self.keys.future(rec.request_id)]
        return bool(int(self._park(keys=keys, args=[message, rec.request_id])))

    def end(self, why: str) -> int:
        """Delete the reservation and put the parked ops back at the head of the queue; how many went back."""
        self.holder = None
        return int(self._release(keys=[self.key, self.keys.reservation_parked(self.queue),
                                       self.keys.reservation_parked_ids(self.queue), self.queue], args=[why]))

    def tick(self) -> str:
        """Run under the pool's lock, from the heartbeat: end a reservation that is over, and one a previous worker
        of this pool left (its run died with it). What happened, for the log ("" = nothing)."""
        held = self.read()
        if self.holder is None:
            if held is None:
                return ""
            released = self.end("the worker holding it stopped")
            return f"cleared a reservation of {held.holder} this worker does not hold; {released} ops back in queue"
        why = "the reservation was removed" if held is None or held.holder != self.holder else held.over()
        if not why:
            return ""
        holder = self.holder
        if self.end_run is not None:
            self.end_run(holder, why)
        released = self.end(why)
        return f"ended the full-parameter run {holder}: {why}; {released} ops back in queue"

    def watch_forever(self, lock: Any, interval: float = 1.0) -> None:
        """`tick` under the pool's lock every `interval` seconds (the pool's own thread)."""
        while True:
            try:
                with lock:
                    note = self.tick()
                if note:
                    log.info("pool %s: %s", self.queue, note)
            except redis.RedisError as exc:
                log.warning("pool %s: reservation check skipped: %s", self.queue, exc)
            except Exception:  # a dead watch would leave a dead client's run holding the pool for good
                log.exception("pool %s: reservation check failed", self.queue)
            time.sleep(interval)


def renew(r: Any, keys: Keys, queue: str, model_id: str) -> Any:
    """Extend the lease of `model_id`'s reservation of `queue`, if it still holds it (sync or asyncio Redis)."""
    return r.eval(_RENEW, 1, keys.pool_reservation(queue), model_id, time.time())


def end_by_operator(r: redis.Redis, keys: Keys, queue: str, why: str) -> Reservation | None:
    """Mark the reservation of `queue` ended; its pool's worker ends the run and frees the pool within a heartbeat."""
    held = Reservation.from_hash(r.hgetall(keys.pool_reservation(queue)))
    if held is not None:
        r.hset(keys.pool_reservation(queue), "ended", why)
    return held


# KEYS: reservation. ARGV: holder, now, lease seconds, max_until (0 = none), owner, session id.
# Taken when free, over (expired, capped or ended) or already the caller's.
_TAKE = """
local holder = redis.call('HGET', KEYS[1], 'holder')
if holder and holder ~= ARGV[1] then
  local ended = redis.call('HGET', KEYS[1], 'ended')
  local expires = tonumber(redis.call('HGET', KEYS[1], 'expires_at') or '0')
  local cap = tonumber(redis.call('HGET', KEYS[1], 'max_until') or '0')
  local over = (ended and ended ~= '') or tonumber(ARGV[2]) >= expires or (cap > 0 and tonumber(ARGV[2]) >= cap)
  if not over then return 0 end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'owner', ARGV[5], 'session_id', ARGV[6], 'since', ARGV[2],
           'expires_at', tonumber(ARGV[2]) + tonumber(ARGV[3]), 'max_until', ARGV[4], 'lease_seconds', ARGV[3],
           'ended', '')
return 1
"""

# KEYS: reservation. ARGV: holder, now.
_RENEW = """
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then return 0 end
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_seconds') or '0')
redis.call('HSET', KEYS[1], 'expires_at', tonumber(ARGV[2]) + lease)
return 1
"""

# KEYS: reservation, parked messages, parked request ids, the op's future. ARGV: message, request id.
_PARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HSET', KEYS[4], 'parked', 'reservation')
return 1
"""

# The queue's consumer pops from the list's right end: the oldest parked message goes there last, so it is
# delivered first, before anything submitted since.
# KEYS: reservation, parked messages, parked request ids, the queue's list. ARGV: why.
_RELEASE = """
local parked = redis.call('LRANGE', KEYS[2], 0, -1)
for i = #parked, 1, -1 do redis.call('RPUSH', KEYS[4], parked[i]) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return #parked
"""
