"""A size limit on every request body, enforced while the body arrives (pure ASGI middleware).

A declared Content-Length over the limit is refused before a byte of the body is read; a chunked body
is counted as it streams and refused the moment it passes the limit, so a 300 MB upload costs the API
at most the limit, never the upload. Compute routes (batches, prompts, encode rows) get the large
`storage.max_request_bytes`; every other route, whose bodies are ids and small settings, gets
`storage.max_control_request_bytes`; the adapter upload (`/import_adapter`, a tar archive) gets
`storage.max_adapter_upload_bytes` and always streams through.

JSON bodies (what FastAPI parses: a JSON content type, or none) are collected here, still counted, and
their nesting depth is checked before anything parses them (see `api.json_depth`); the app then reads
them from memory. Other bodies (protobuf) stream through, counted.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from api.json_depth import MAX_JSON_DEPTH, nests_deeper_than

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Last path segments of the routes that carry data rather than settings (Tinker and Twinkle routes, and
# OpenAI-style completions): they get the large limit.
COMPUTE_ROUTES = ("/forward_backward", "/forward", "/forward_only", "/asample", "/encode", "/completions")
UPLOAD_ROUTES = ("/import_adapter",)  # file uploads: their own limit, never collected in memory


class _TooLarge(Exception):
    """The body passed its limit while the app was reading it."""


class BodyLimit:
    def __init__(self, app: App, *, max_bytes: int, max_control_bytes: int, max_upload_bytes: int | None = None,
                 max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_control_bytes = min(max_control_bytes, max_bytes)
        self.max_upload_bytes = max_upload_bytes or max_bytes
        self.max_depth = max_depth

    def limit_for(self, path: str) -> int:
        if _is_upload(path):
            return self.max_upload_bytes
        return self.max_bytes if path.rstrip("/").endswith(COMPUTE_ROUTES) else self.max_control_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Headers are looked up, not copied into a dict: this frame stays alive as long as the request (a parked
        # long-poll for minutes, thousands at once).
        limit = self.limit_for(scope["path"])
        declared = _header(scope, b"content-length") or ""
        if declared.isdigit() and int(declared) > limit:
            await _refuse_too_large(send, scope, limit, int(declared))
            return
        if _is_json(scope) and not _is_upload(scope["path"]):
            await self._json(scope, receive, send, limit)
        else:
            await self._streamed(scope, receive, send, limit)

    async def _json(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse_too_large(send, scope, limit, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        if nests_deeper_than(body, self.max_depth):
            await _refuse(send, scope, 400, "invalid_request", f"The JSON body nests deeper than {self.max_depth} "
                          "levels. Flatten the nested lists and objects; no field of this API nests that deep.")
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered, body
            if delivered:
                return await receive()  # after the body: waits for the disconnect, as the server would
            delivered = True
            message, body = {"type": "http.request", "body": body, "more_body": False}, b""
            return message

        await self.app(scope, replay, send)

    async def _streamed(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        size, over = 0, False

        async def counted() -> Message:
            nonlocal size, over
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    over = True
                    raise _TooLarge
            return message

        async def guarded(message: Message) -> None:
            if not over:  # whatever the app answers to a body cut short, the 413 below replaces it
                await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over:
            await _refuse_too_large(send, scope, limit, None)


def _header(scope: Scope, name: bytes) -> str | None:
    """The last value of header `name` (lower case)."""
    found = None
    for key, value in scope["headers"]:
        if key.lower() == name:
            found = value
    return None if found is None else bytes(found).decode("latin-1")


def _is_json(scope: Scope) -> bool:
    if (_header(scope, b"content-encoding") or "identity").strip().lower() not in ("", "identity"):
        return False  # compressed: the route decompresses, bounded, and checks the depth itself
    kind = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
    return not kind or kind == "application/json" or kind.endswith("+json")


def _is_upload(path: str) -> bool:
    return path.rstrip("/").endswith(UPLOAD_ROUTES)


async def _refuse_too_large(send: Send, scope: Scope, limit: int, declared: int | None) -> None:
    path = scope["path"]
    size = f"{declared} bytes" if declared is not None else "more than that"
    what = ("Upload a smaller adapter (the operator sets the limit: storage.max_adapter_upload_bytes)."
            if _is_upload(path) else "Send smaller requests (split a batch into chunks).")
    await _refuse(send, scope, 413, "payload_too_large", f"The request body is {size}; this route accepts at "
                  f"most {limit} bytes. {what}")


async def _refuse(send: Send, scope: Scope, status: int, code: str, message: str) -> None:
    rid = _header(scope, b"x-request-id") or uuid.uuid4().hex[:16]
    body = json.dumps({"error": message, "category": "user", "code": code, "request_id": rid}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid.encode("latin-1")), (b"x-should-retry", b"false"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
