"""Each API key's share of an API process: at most `per_key` of its requests are handled at once.

The event loop serves requests first come, first served. A client that keeps dozens of requests in flight
(and resends each the moment it is answered, 429 or not) therefore has dozens of handlers interleaved
with everyone else's, and a burst of them is a burst of latency for every other tenant on the process.
With a share, its further requests wait, costing nothing, until one of its own finishes; other keys'
requests never wait for it. A 429 that the tarpit holds keeps its slot while held, so a key that ignores
its 429s slows itself, not the others.

Only what returns quickly is shared: POST routes of the Tinker and Twinkle APIs (validate, then submit a
future). A parked long-poll (`retrieve_future`), an OpenAI-style completion that waits for its tokens, and
downloads (GET) hold their request for seconds and would starve the key's own submissions; they are not
counted. Requests without a key are not counted either (they are refused with 401 at once).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

PER_KEY = 8
KEY_HEADERS = (b"x-api-key", b"authorization")
UNSHARED_SUFFIXES = ("/retrieve_future", "/completions")


def shared(scope: Scope) -> bool:
    return (scope["type"] == "http" and scope["method"] == "POST"
            and not str(scope["path"]).endswith(UNSHARED_SUFFIXES))


def api_key_of(scope: Scope) -> bytes:
    for name, value in scope["headers"]:
        if name in KEY_HEADERS:
            return bytes(value)
    return b""


class KeyShare:
    def __init__(self, app: ASGIApp, *, per_key: int = PER_KEY) -> None:
        self.app = app
        self.per_key = per_key
        self.in_flight: dict[bytes, asyncio.Semaphore] = {}
        self.users: dict[bytes, int] = {}  # requests of a key in the process: handled or waiting for a slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = api_key_of(scope) if shared(scope) else b""
        if not key:
            await self.app(scope, receive, send)
            return
        slots = self.in_flight.get(key)
        if slots is None:
            slots = self.in_flight[key] = asyncio.Semaphore(self.per_key)
        self.users[key] = self.users.get(key, 0) + 1
        try:
            async with slots:
                await self.app(scope, receive, send)
        finally:
            self.users[key] -= 1
            if not self.users[key]:  # nobody holds or waits: forget the key (millions of keys, no growth)
                del self.users[key], self.in_flight[key]
