"""The lease that makes one pool worker the only consumer of its queue, and the token that fences off a worker
that lost it.

Two consumers of one pool queue split an adapter's ops between a process that holds its weights and one that
does not (`adapter_state_lost`), and each puts the other's unacked messages back as orphans. So a pool worker
takes its queue's lease before it loads its model, and keeps it:

- `acquire()` writes the lease (a hash naming host, pid, since and a token new to this acquisition) with an
  expiry of `seconds`, and the fence key to the token. While another live worker holds it, PoolLeaseHeld
  names that worker in one line. A holder on this host whose process is gone (SIGKILLed) is replaced at
  once; one elsewhere, or frozen, only once its lease expired.
- A daemon thread of its own (`start_renewing`) renews it every fifth of `seconds`. A lease key that is
  missing (a broker restarted without persistence) is claimed again with the same token; a broker that does
  not answer is waited out. Only a fence naming another token means another worker took over: the worker
  exits at once (PoolExit.LEASE_LOST), and the launcher's restart is refused while that one holds the lease.
- The fence key keeps the latest acquisition's token with no expiry, so a holder whose lease expired while
  it was frozen still writes when nobody took over, and stays fenced off when someone did (even if that
  one stopped since). The runtime's scripts that begin and finish an op check it in the same script as
  their write (workers/runtime.py): a fenced-off worker writes no outcome.
- `release()` on a clean stop deletes the lease if it is still ours, so a restart does not wait.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import redis

from twinkle.errors import PoolLeaseHeld
from twinkle.keys import Keys
from twinkle.ledger.messages import restore_unacked
from twinkle.pool_exit import PoolExit

log = logging.getLogger("twinkle.worker")
RENEWALS_PER_LEASE = 5
ACQUIRE_TRIES = 3  # the holder may change between our look and our claim


@dataclass(frozen=True)
class Holder:
    """Who holds a pool queue's lease, as its hash names it."""

    host: str
    node: str  # boot and pid namespace: a pid means the same process only where these match
    pid: int
    started: str  # the process's start time since boot (a reused pid has another)
    since: float
    token: str
    expires_in: float  # seconds

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes], ttl_ms: int) -> Holder:
        text = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(host=text.get("host", "?"), node=text.get("node", ""), pid=int(text.get("pid") or 0),
                   started=text.get("started", ""), since=float(text.get("since") or 0),
                   token=text.get("token", ""), expires_in=max(ttl_ms, 0) / 1000)

    def gone(self) -> bool:
        """True when it ran on this host and its process no longer exists (its lease can go at once)."""
        return self.host == socket.gethostname() and self.node == this_node() and not process_alive(
            self.pid, self.started)

    def line(self, queue: str) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return (f"pool queue {queue} is already consumed by pid {self.pid} on host {self.host} since {since}; "
                f"its lease expires in {self.expires_in:.0f} s unless that worker renews it")


class PoolLease:
    def __init__(self, r: redis.Redis, keys: Keys, queue: str, seconds: float, *,
                 on_lost: Callable[[str], Any] | None = None, host: str | None = None) -> None:
        self.r = r  # a client of its own with short timeouts: a renewal must not wait out the pool's retries
        self.queue = queue
        self.seconds = seconds
        self.key = keys.pool_lease(queue)
        self.fence_key = keys.pool_lease_fence(queue)
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.host = host or socket.gethostname()
        self.on_lost = on_lost if on_lost is not None else exit_lost  # tests: one that records, not exits
        self.since = 0.0
        self.confirmed_at = 0.0  # time.monotonic() of the last acquisition or renewal the broker confirmed
        self._acquire = r.register_script(_ACQUIRE)
        self._renew = r.register_script(_RENEW)
        self._release = r.register_script(_RELEASE)
        self._stop = threading.Event()

    @property
    def renew_every(self) -> float:
        return self.seconds / RENEWALS_PER_LEASE

    def holder(self) -> Holder | None:
        return read_holder(self.r, self.key)

    def acquire(self) -> None:
        """Take the lease, or raise PoolLeaseHeld naming the live worker that holds it."""
        self.since = time.time()
        for _ in range(ACQUIRE_TRIES):
            holder = self.holder()
            if holder is not None and not holder.gone():
                raise self._held(holder)
            replace = holder.token if holder is not None else ""
            if self._acquire(keys=[self.key, self.fence_key], args=[
                    self.token, int(self.seconds * 1000), replace, *self._fields()]):
                self.confirmed_at = time.monotonic()
                if holder is not None:
                    log.warning("pool %s: took the lease of pid %d on this host, which is gone", self.queue,
                                holder.pid)
                return
        holder = self.holder()
        raise self._held(holder) if holder is not None else PoolLeaseHeld(
            f"pool queue {self.queue} changed hands {ACQUIRE_TRIES} times while this worker tried to take it",
            hint="Run exactly one worker per pool.")

    def take_over_queue(self) -> int:
        """Put the previous holder's unacked messages back at the head of the queue (a just-taken lease makes
        this worker their only consumer); how many."""
        restored = restore_unacked(self.r, self.queue)
        if restored:
            log.warning("pool %s: put %d unacked message(s) of the previous worker back", self.queue, restored)
        return restored

    def renew(self) -> str:
        """One renewal: "renewed", "reclaimed" (the key was missing), or "lost" (another worker took over;
        `on_lost` has been called). Broker errors propagate."""
        outcome = self._renew(keys=[self.key, self.fence_key],
                              args=[self.token, int(self.seconds * 1000), *self._fields()])
        outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if outcome == "lost":
            self.lost("another worker took over its queue's lease")
        else:
            if outcome == "reclaimed":
                log.warning("pool %s: its lease was missing from the broker (restarted?); claimed it again",
                            self.queue)
            self.confirmed_at = time.monotonic()
        return outcome

    def fresh(self) -> bool:
        """Whether the broker confirmed our lease within its time: a worker frozen or cut off longer may have
        been replaced, and writes nothing outside the fenced scripts until its next renewal says."""
        return time.monotonic() - self.confirmed_at < self.seconds

    def lost(self, why: str) -> None:
        """This worker is fenced off: stop consuming now."""
        self.on_lost(f"pool {self.queue}: {why}; exiting with code {int(PoolExit.LEASE_LOST)} without writing "
                     "anything more")

    def release(self) -> bool:
        """Delete the lease if it is still ours (a clean stop); True when it was."""
        self._stop.set()
        try:
            return bool(self._release(keys=[self.key], args=[self.token]))
        except redis.RedisError:
            return False  # it expires on its own

    def start_renewing(self) -> threading.Thread:
        thread = threading.Thread(target=self._renew_forever, name="pool-lease", daemon=True)
        thread.start()
        return thread

    def check_on_resume(self) -> None:
        """After SIGCONT, renew at once if the lease may have lapsed, before the consumer takes another message
        (the main thread runs signal handlers before it reads the broker's next reply)."""

        def resumed(_signum: int, _frame: Any) -> None:
            if not self.fresh() and not self._stop.is_set():
                try:
                    self.renew()
                except redis.RedisError:
                    pass  # the renewal thread keeps trying

        signal.signal(signal.SIGCONT, resumed)

    def _renew_forever(self) -> None:
        while not self._stop.wait(self.renew_every):
            try:
                self.renew()
            except redis.RedisError:
                pass  # the broker is away: keep the lease in mind; only another token means it is lost
            except Exception:  # a dead renewal thread would lose the lease of a healthy worker
                log.exception("pool %s: renewing its lease failed; trying again", self.queue)

    def _held(self, holder: Holder) -> PoolLeaseHeld:
        return PoolLeaseHeld(
            holder.line(self.queue) + ".",
            hint="Run exactly one worker per pool: stop that worker first (its lease goes with a clean stop), "
                 f"or, if its host is gone, start this one after the lease expired (broker.pool_lease_seconds "
                 f"= {self.seconds:g})")

    def _fields(self) -> list[str | int | float]:
        return [self.host, this_node(), os.getpid(), process_started(os.getpid()), self.since]


def exit_lost(why: str) -> NoReturn:
    log.error("%s", why)
    logging.shutdown()
    os._exit(PoolExit.LEASE_LOST)  # now: the op thread must not ack, the consumer must not take another message


def client_for(url: str, seconds: float) -> redis.Redis:
    """A broker client for the lease alone: a renewal fails fast while the broker is away (and is tried again a
    fifth of the lease later) instead of waiting out the pool client's minute of retries."""
    timeout = max(0.5, min(2.0, seconds / RENEWALS_PER_LEASE))
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


def read_holder(r: redis.Redis, key: str) -> Holder | None:
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(key)
    pipe.pttl(key)
    raw, ttl = pipe.execute()
    return Holder.from_hash(raw, int(ttl)) if raw else None


def vacant(r: redis.Redis, keys: Keys, queue: str) -> bool:
    """Whether no live worker holds `queue`'s lease: none, or one of this host whose process is gone."""
    holder = read_holder(r, keys.pool_lease(queue))
    return holder is None or holder.gone()


def restore_if_vacant(r: redis.Redis, keys: Keys, queue: str) -> int:
    """The launcher's repair before it starts a pool worker: put the queue's unacked messages back, unless a
    live worker (another launcher's, another host's) holds the queue: they are its messages."""
    return restore_unacked(r, queue) if vacant(r, keys, queue) else 0


def this_node() -> str:
    """This boot and pid namespace: a pid names the same process only within both."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def process_started(pid: int) -> str:
    """When process `pid` started, in clock ticks since boot ("" where /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else ""


def process_alive(pid: int, started: str = "") -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = process_started(pid)
    return not (started and now and now != started)  # the pid was reused by a process started since


# KEYS: lease, fence. ARGV: token, lease ms, token it may replace ('' = only a vacant lease), host, node, pid,
# started, since.
_ACQUIRE = """
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'host', ARGV[4], 'node', ARGV[5], 'pid', ARGV[6],
           'started', ARGV[7], 'since', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""

# KEYS: lease, fence. ARGV: token, lease ms, host, node, pid, started, since.
_RENEW = """
local fence = redis.call('GET', KEYS[2])
if fence and fence ~= ARGV[1] then return 'lost' end
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[1] then return 'lost' end
if holder then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 'renewed'
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'host', ARGV[3], 'node', ARGV[4], 'pid', ARGV[5],
           'started', ARGV[6], 'since', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
return 'reclaimed'
"""

# KEYS: lease. ARGV: token.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
