"""One shared pub/sub listener per API process that wakes long-polls when their future finishes.

Waiters register an asyncio future per channel; the first waiter of a channel SUBSCRIBEs, the last
one UNSUBSCRIBEs. `register` returns once Redis confirmed the subscription: Redis may run a command sent
later on another connection (the waiter's re-read of the record) before the SUBSCRIBE, so a result
published in between would be missed (seen: a 5 s stall about once in 700 ops). After that the waiter
re-reads the record, and it re-reads every few seconds in case a message was lost to a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

import redis.asyncio as aioredis

log = logging.getLogger("twinkle.api.hub")
CONFIRM_SECONDS = 2.0  # past this a waiter goes on unconfirmed; its periodic re-read still finds the result


class FutureHub:
    def __init__(self, r: aioredis.Redis) -> None:
        self._r = r
        self._pubsub = r.pubsub()
        self._waiters: dict[str, set[asyncio.Future[None]]] = defaultdict(set)
        self._confirmations: dict[str, asyncio.Future[None]] = {}
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    @property
    def pending(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_forever(), name="twinkle-future-hub")

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()

    async def register(self, channel: str) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        async with self._lock:
            first = not self._waiters[channel]
            self._waiters[channel].add(waiter)
            if first:
                self._confirmations[channel] = asyncio.get_running_loop().create_future()
                await self._pubsub.subscribe(channel)
                self._subscribed.set()
            confirmation = self._confirmations.get(channel)
        if confirmation is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(confirmation), CONFIRM_SECONDS)
        return waiter

    async def unregister(self, channel: str, waiter: asyncio.Future[None]) -> None:
        async with self._lock:
            waiters = self._waiters.get(channel)
            if waiters is None:
                return
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[channel]
                self._confirmations.pop(channel, None)
                with contextlib.suppress(Exception):
                    await self._pubsub.unsubscribe(channel)

    async def _read_forever(self) -> None:
        while True:
            try:
                if not self._pubsub.subscribed:
                    # get_message needs a subscription; wait for the first waiter (clear, then re-check,
                    # so that a waiter registering in between is never missed)
                    self._subscribed.clear()
                    if not self._pubsub.subscribed:
                        await self._subscribed.wait()
                message = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect and let waiters re-read on their timer
                log.warning("pub/sub listener lost the broker (%s); reconnecting", exc)
                await asyncio.sleep(0.5)
                await self._resubscribe()
                continue
            kind = message.get("type") if message else None
            if kind not in ("message", "subscribe"):
                continue
            channel = message["channel"]
            channel = channel.decode() if isinstance(channel, bytes) else channel
            if kind == "subscribe":
                confirmation = self._confirmations.get(channel)
                if confirmation is not None and not confirmation.done():
                    confirmation.set_result(None)
                continue
            for waiter in list(self._waiters.get(channel, ())):
                if not waiter.done():
                    waiter.set_result(None)

    async def _resubscribe(self) -> None:
        async with self._lock:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
            self._pubsub = self._r.pubsub()
            channels = list(self._waiters)
            if channels:
                with contextlib.suppress(Exception):
                    await self._pubsub.subscribe(*channels)
