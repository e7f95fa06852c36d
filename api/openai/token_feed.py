"""Following a sample op for a streamed answer: its tokens as the sampler pool publishes them, then its output.

The feed subscribes to a fresh channel before the op is submitted (so no token is published unheard), and
to the op's done channel once its id is known, then re-reads the future (closing the race with an op that
finished in between). Token messages carry offsets: after a gap (a lost message) a sample's preview stops
growing, and the final output, which is always read, completes it. Pools that cannot stream (mock, a model
pool sampling itself) publish nothing; the output then arrives whole.

Each open feed holds one Redis connection for its subscription, until the answer ends or the client leaves.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from api.context import ApiContext
from twinkle.types import SampleOutput

Check = Callable[[float], Awaitable[SampleOutput | None]]  # the op's output within a timeout, or None


class TokenFeed:
    def __init__(self, ctx: ApiContext, pubsub: Any, channel: str) -> None:
        self.ctx = ctx
        self.pubsub = pubsub
        self.channel = channel

    @classmethod
    async def open(cls, ctx: ApiContext) -> TokenFeed:
        channel = ctx.keys.sample_stream(secrets.token_hex(12))
        return cls(ctx, await ctx.store.subscription(channel), channel)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.pubsub.aclose()

    async def follow(self, request_id: str, check: Check, keepalive: float
                     ) -> AsyncIterator[list[list[int]] | SampleOutput | None]:
        """Token rows so far (one list per sample) as they grow, None every `keepalive` seconds without news,
        and finally the output. Closes the feed when done."""
        try:
            await self.pubsub.subscribe(self.ctx.keys.done_channel(request_id))
            rows: list[list[int]] = []
            stale: set[int] = set()  # samples whose preview missed a message
            reread = True
            while True:
                if reread and (out := await check(0)) is not None:
                    yield out
                    return
                message = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=keepalive)
                channel = message.get("channel") if message else None
                channel = channel.decode() if isinstance(channel, bytes) else channel
                if channel != self.channel:  # done, a timeout, or a subscribe confirmation: read the future
                    reread = True
                    if message is None:
                        yield None
                    continue
                reread = False
                if _apply(rows, stale, message["data"]):
                    yield [list(row) for row in rows]
        finally:
            await self.close()


async def follow_without_feed(check: Check, keepalive: float) -> AsyncIterator[SampleOutput | None]:
    while (out := await check(keepalive)) is None:
        yield None
    yield out


def _apply(rows: list[list[int]], stale: set[int], data: Any) -> bool:
    try:
        updates = json.loads(data)["rows"]
    except (ValueError, KeyError, TypeError):
        return False
    grew = False
    for index, (offset, tokens) in enumerate(updates):
        while len(rows) <= index:
            rows.append([])
        if index in stale or offset != len(rows[index]):
            stale.add(index)
            continue
        if tokens:
            rows[index].extend(int(t) for t in tokens)
            grew = True
    return grew
