"""The access log: one INFO line per HTTP request, so an operator can find any answer by its request id.

A line reads

    POST /api/v1/forward_backward 400 12.3ms rid=3f9c0a1b2c3d4e5f tenant=t1a2b3c4d5e6f7a8b9c0d1

`route` is the matched route's template (`/api/v1/sessions/{session_id}`, so ids stay out of the log)
or, when no route matched, the requested path cut to a safe length. The request id is the one the error
body carries (`request_id`) and the `x-request-id` response header: the client's own `x-request-id` when
it sent one, else a fresh one. The tenant is the one-way tenant hash the auth dependency derived from
the key (`-` before authentication); a raw key never reaches the log. The lines go to the
`twinkle.api.access` logger at INFO. When the API process logs at WARNING (a quiet `launch`, whose terminal
shows state changes and errors only) the failures (status >= 400) are still written at INFO and the
successes drop to DEBUG (`configure_from_env`); `launch -v` or TWINKLE_LOG_LEVEL=INFO logs every request.

It is plain ASGI rather than a Starlette BaseHTTPMiddleware, which would buffer streamed bodies
(long polls, file downloads) and run the app in a separate task.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twinkle.telemetry.gateway import route_template

log = logging.getLogger("twinkle.api.access")
SWITCH_ENV = "TWINKLE_ACCESS_LOG"  # "0" / "off" turns the access log off

_MAX_PATH_CHARS = 120
_MAX_REQUEST_ID_CHARS = 64


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            # Only a printable token is echoed back: a client cannot inject log lines or huge headers.
            if text and len(text) <= _MAX_REQUEST_ID_CHARS and text.isascii() and text.isprintable() \
                    and " " not in text:
                return text
    return None


def _route_of(scope: Scope) -> str:
    if scope.get("route") is not None:
        return route_template(dict(scope))
    path = str(scope.get("path", ""))
    safe = "".join(c if c.isascii() and c.isprintable() and c != " " else "?" for c in path)
    return safe if len(safe) <= _MAX_PATH_CHARS else safe[:_MAX_PATH_CHARS] + "..."


_success_level = logging.INFO


def configure_from_env() -> None:
    """Keep the failures' lines at INFO even when the process logs at WARNING (a quiet `launch` runs its children
    so): the operator needs the line a user's request id points to. TWINKLE_ACCESS_LOG=0 turns it off."""
    global _success_level
    off = os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "off", "false", "no")
    quiet = logging.getLogger().getEffectiveLevel() > logging.INFO
    _success_level = logging.DEBUG if quiet else logging.INFO
    log.setLevel(logging.CRITICAL + 1 if off else logging.INFO)


class AccessLog:
    """ASGI middleware: assigns the request id, then logs method, route, status, duration and tenant."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        request_id = state.get("request_id") or _client_request_id(scope) or uuid.uuid4().hex[:16]
        state["request_id"] = request_id  # api.errors.request_id_of reads it: error bodies carry the same id
        status = 500  # what the server answers if the app raises before sending a response
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = list(message.get("headers") or [])
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", request_id.encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed_ms = (time.perf_counter() - started) * 1000
            log.log(logging.INFO if status >= 400 else _success_level, "%s %s %d %.1fms rid=%s tenant=%s",
                    scope.get("method", "?"), _route_of(scope), status, elapsed_ms, request_id,
                    state.get("tenant") or "-")
