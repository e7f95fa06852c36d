"""A key's share of an API process: its requests past the share wait for its own to finish, other keys'
requests and long-polls never wait for it, and a key with nothing in flight is forgotten."""

from __future__ import annotations

import asyncio
from typing import Any

from api.key_share import KeyShare


class HeldApp:
    """An ASGI app whose requests stay in it until released; it counts how many are inside at once."""

    def __init__(self) -> None:
        self.inside: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.inside.append(scope["path"])
        await self.release.wait()
        self.inside.remove(scope["path"])


def request(path: str, key: bytes = b"k1", method: str = "POST") -> dict[str, Any]:
    headers = [(b"x-api-key", key)] if key else []
    return {"type": "http", "method": method, "path": path, "headers": headers}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_keys_requests_past_its_share_wait_while_another_keys_go_through() -> None:
    app = HeldApp()
    share = KeyShare(app, per_key=2)
    mine = [asyncio.create_task(share(request(f"/api/v1/optim_step#{i}"), None, None)) for i in range(5)]
    await settle()
    assert len(app.inside) == 2
    other = asyncio.create_task(share(request("/api/v1/forward_backward", key=b"k2"), None, None))
    await settle()
    assert "/api/v1/forward_backward" in app.inside and len(app.inside) == 3
    app.release.set()
    await asyncio.gather(*mine, other)
    assert share.in_flight == {} and share.users == {}  # nothing in flight: the keys are forgotten


async def test_long_polls_completions_and_downloads_do_not_count_against_the_share() -> None:
    app = HeldApp()
    share = KeyShare(app, per_key=1)
    held = [asyncio.create_task(share(scope, None, None)) for scope in (
        request("/api/v1/retrieve_future"), request("/api/v1/retrieve_future"), request("/v1/chat/completions"),
        request("/api/v1/downloads/run/weights/a/archive.tar", method="GET"), request("/api/v1/optim_step"))]
    await settle()
    assert len(app.inside) == 5 and share.users == {b"k1": 1}
    app.release.set()
    await asyncio.gather(*held)


async def test_requests_without_a_key_are_not_counted() -> None:
    app = HeldApp()
    share = KeyShare(app, per_key=1)
    held = [asyncio.create_task(share(request("/api/v1/create_session", key=b""), None, None)) for _ in range(3)]
    await settle()
    assert len(app.inside) == 3 and share.users == {}
    app.release.set()
    await asyncio.gather(*held)


async def test_a_request_that_fails_gives_its_slot_back() -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    share = KeyShare(failing, per_key=1)
    for _ in range(3):
        try:
            await asyncio.wait_for(share(request("/api/v1/optim_step"), None, None), 1)
        except RuntimeError:
            pass
    assert share.users == {}
