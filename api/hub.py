"""One pub/sub connection per API process that wakes long-polls when their future finishes.

The hub PSUBSCRIBEs once to every future's done channel (`<root>done:*`), so a parked long-poll holds no
Redis connection and costs no command: registering is a dict insert. Wake-ups cannot be lost:

- while the subscription is confirmed, a result published after a waiter registered reaches the hub, and
  one published before is seen by the waiter's own read of the record, which comes after registering;
- when the connection drops, the hub reconnects, and once Redis confirmed the new subscription it re-reads
  every waiter's record, waking those that finished (or whose broker restarted) meanwhile;
- every RECHECK_SECONDS the same batched re-read runs anyway, in case a message was lost some other way.

A poll of a future this process submitted skips that first read while the subscription has held since the submit:
the hub notes every done message of such a future, so none yet means it has not ended (api/submitted.py). A done
message that carries a completed op's result wakes its waiters with it, and they answer without a read.

A re-read runs on the Redis server (one script call per READ_BATCH records, answering only the ones to wake):
read from Python, one HMGET per record, 10,000 parked polls cost the API's event loop about 0.6 s of every
RECHECK_SECONDS, in stalls of 50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

import redis.asyncio as aioredis

from api.submitted import SubmittedHere
from twinkle.keys import Keys
from twinkle.ledger import AsyncLedger, lifecycle

log = logging.getLogger("twinkle.api.hub")
RECHECK_SECONDS = 5.0  # batched re-read of every parked waiter, in case a message was lost
CONFIRM_SECONDS = 5.0  # a PSUBSCRIBE not confirmed within this is treated as a lost connection
RECONNECT_SECONDS = 0.5
READ_BATCH = 500  # records per script call in a re-read


class Waiter:
    """One parked long-poll, woken when its future may have changed (by the hub) or its time ran out.

    Not an asyncio.Event: thousands are parked at once, and an Event keeps a dict and a deque of waiters
    (about 0.9 KB) where one waiting coroutine needs a flag and, while it waits, one future.
    """

    __slots__ = ("_wakeup", "expired", "request_id", "result", "woken")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.woken = False  # since the last clear()
        self.expired = False
        self.result: bytes | None = None  # the completed future's result, when its done message carried it
        self._wakeup: asyncio.Future[None] | None = None

    def wake(self, result: bytes | None = None) -> None:
        self.woken = True
        if result is not None:
            self.result = result
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def expire(self) -> None:
        """The long-poll's time ran out: wake it for good."""
        self.expired = True
        self.wake()

    def clear(self) -> None:
        self.woken = False
        self.result = None

    async def wait(self) -> None:
        """Until woken; at once if it was since the last clear(). One coroutine waits at a time."""
        if self.woken:
            return
        self._wakeup = asyncio.get_running_loop().create_future()
        try:
            await self._wakeup
        finally:
            self._wakeup = None


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class FutureHub:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self._r = r
        self._channel_prefix = keys.done_channel("")
        self._pattern = _glob_escape(self._channel_prefix) + "*"
        self._keys = keys
        self._waiters: dict[str, set[Waiter]] = defaultdict(set)
        self._tasks: list[asyncio.Task[None]] = []
        self._recheck_now = asyncio.Event()
        self.subscribed = asyncio.Event()  # set while Redis has confirmed the pattern subscription
        self.reconnects = 0
        self._ledger = AsyncLedger(r)
        self.submitted = SubmittedHere()  # what the done messages tell of this process's own submits

    @property
    def pending(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._listen_forever(), name="twinkle-future-hub"),
                       asyncio.create_task(self._recheck_forever(), name="twinkle-future-hub-recheck")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def register(self, request_id: str) -> Waiter:
        """Park a waiter for `request_id`; the caller must read the record after this returns."""
        waiter = Waiter(request_id)
        self._waiters[request_id].add(waiter)
        return waiter

    def unregister(self, waiter: Waiter) -> None:
        waiters = self._waiters.get(waiter.request_id)
        if waiters is None:
            return
        waiters.discard(waiter)
        if not waiters:
            del self._waiters[waiter.request_id]

    def _wake(self, request_id: str, result: bytes | None = None) -> None:
        for waiter in self._waiters.get(request_id, ()):
            waiter.wake(result)

    # -- the subscription ----------------------------------------------------------------------

    async def _listen_forever(self) -> None:
        while True:
            pubsub = self._r.pubsub()
            try:
                await pubsub.psubscribe(self._pattern)
                await self._confirmed(pubsub)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message.get("type") == "psubscribe":  # redis-py resubscribed on its own
                        self._recheck_now.set()
                        continue
                    if message.get("type") != "pmessage":
                        continue
                    channel = message["channel"]
                    channel = channel.decode() if isinstance(channel, bytes) else channel
                    if channel.startswith(self._channel_prefix):
                        data = message.get("data")
                        request_id = channel[len(self._channel_prefix):]
                        result = lifecycle.done_result(data) if isinstance(data, bytes) else None
                        self.submitted.ended(request_id, result)
                        self._wake(request_id, result)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect; the re-read after it wakes what was missed
                if self.subscribed.is_set():
                    log.warning("future hub lost the broker (%s); reconnecting", exc)
                self.subscribed.clear()
                self.submitted.unsubscribed()
                self.reconnects += 1
                await asyncio.sleep(RECONNECT_SECONDS)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _confirmed(self, pubsub: aioredis.client.PubSub) -> None:
        """Wait for Redis to confirm the subscription, then re-read every waiter (messages sent before it
        was confirmed never reach us)."""
        async with asyncio.timeout(CONFIRM_SECONDS):
            while True:
                message = await pubsub.get_message(timeout=CONFIRM_SECONDS)
                if message is not None and message.get("type") == "psubscribe":
                    break
        self.subscribed.set()
        self.submitted.subscribed()
        self._recheck_now.set()

    # -- batched re-reads ----------------------------------------------------------------------

    async def _recheck_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck_now.wait(), RECHECK_SECONDS)
            self._recheck_now.clear()
            if not self._waiters:
                continue
            try:
                await self.recheck()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the broker is away; the next round tries again
                log.debug("future hub re-read failed: %s", exc)

    async def recheck(self) -> int:
        """Re-read every waiter's record (one script call per READ_BATCH) and wake those that finished, vanished
        or outlived their broker (the long-poll's own read then decides). Returns how many it woke."""
        ids = list(self._waiters)
        info = await self._r.info("server")
        run_id = str(info.get("run_id", ""))
        woken = 0
        for start in range(0, len(ids), READ_BATCH):
            batch = ids[start:start + READ_BATCH]
            for index in await self._ledger.run(lifecycle.to_wake(self._keys, batch, run_id)):
                self._wake(batch[index])
                woken += 1
        return woken

