"""Where a long-poll waits for its future: `await_future`, and the ASGI middleware that parks `retrieve_future`
polls before the framework builds a request.

Thousands of polls sit parked at once (a client keeps one per future in flight), and what a parked poll
costs is what it holds while it waits. Parked inside its route it held FastAPI's whole request: about thirty
nested coroutines, three exit stacks, two Request objects, the solved dependencies, the validated body and a
timeout task, some 22 KB beyond what uvicorn itself keeps per connection. `LongPolls` parks it in plain ASGI
instead, after the body's size and depth checks and before routing, holding the scope, the body bytes and one
`Waiter`; once the future ended (or the long-poll's time ran out) it hands the request to the app, whose
route answers from the record the wait ended with (`parked_poll`) rather than waiting again.

It answers the poll of a future that ended itself, with the bytes the route would send (api/future_answer.py):
its result, or the three fields of a failure. Every training step ends in such polls, two of the four requests
the Tinker SDK sends a step, and failures come in floods (a lost adapter's thousands of queued ops fail
together, workers.lost_adapters); through the framework each would cost the routing, the dependencies and the
body's validation again, CPU that other tenants' requests wait behind. A `try_again` comes from the route.
A request it cannot read as a valid poll of a known caller (a body that does not parse or validate, no key or an
unknown one, a future the caller cannot see, a broker that fails) goes to the app at once, which answers it as it
would have (400, 401, 404, 503, ...). A wait that ends in an error passes the remaining time on, so the route
waits no longer than the poll would have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from api.context import ApiContext
from api.finite_json import finite_json_bytes
from api.future_answer import JSON, accepts_protobuf, failed_answer, result_answer
from api.schemas import RetrieveFutureBody
from twinkle.auth import key_from_headers
from twinkle.errors import TwinkleError
from twinkle.futures import FutureRecord, FutureStatus

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

STATE_KEY = "twinkle.parked_poll"  # in scope["state"], where the route finds the wait's outcome


async def await_future(ctx: ApiContext, request_id: str, tenant: str, timeout: float) -> FutureRecord:
    """The record once terminal or `timeout` passed. The waiter is registered before the first read, so a
    result published after that read wakes it; a parked poll holds no Redis connection: the hub wakes it
    (pub/sub, or its batched re-read), and only then is the record read again."""
    waiter = ctx.hub.register(request_id)
    # One timer for the whole wait rather than a timeout per round (asyncio.wait_for runs a task of its own).
    deadline = asyncio.get_running_loop().call_later(timeout, waiter.expire) if timeout > 0 else None
    if deadline is None:
        waiter.expire()
    first = True
    try:
        while True:
            waiter.clear()  # before the read: a wake-up after it is kept for the wait below
            # A future this process submitted, while the done messages tell all of it, is not read (api/submitted.py)
            known = ctx.hub.submitted.known(request_id, tenant) if first and not waiter.expired else None
            first = False
            if known is not None and known.ended:
                if known.result is not None:
                    return _completed(ctx, known.record, known.result)
                known = None  # it ended, and the message said only how: read it
            if known is None:
                record = await ctx.store.future(request_id, tenant)
                if record.state.terminal or waiter.expired:
                    ctx.hub.submitted.forget(request_id)
                    return record
            else:
                record = known.record
            await waiter.wait()
            if waiter.result is not None:  # its done message carried the result: no read back
                return _completed(ctx, record, waiter.result)
    finally:
        if deadline is not None:
            deadline.cancel()
        ctx.hub.unregister(waiter)


def _completed(ctx: ApiContext, record: FutureRecord, result: bytes) -> FutureRecord:
    """The record of a future whose done message carried its result, which the `result` call then answers."""
    ctx.hub.submitted.forget(record.request_id)
    ctx.store.keep_result(record.request_id, result)
    return dataclasses.replace(record, status=FutureStatus.COMPLETED.value)


@dataclass(frozen=True, slots=True)
class ParkedPoll:
    """What `LongPolls` learnt while a poll was parked: the caller and future it waited for, the record the
    wait ended with (None when the wait ended in an error), and when the long-poll's time runs out."""

    request_id: str
    tenant: str
    record: FutureRecord | None
    deadline: float

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def parked_poll(scope: Scope, request_id: str, tenant: str) -> ParkedPoll | None:
    """The parked wait of this very poll (same future, same caller), if `LongPolls` parked it."""
    parked = (scope.get("state") or {}).get(STATE_KEY)
    if isinstance(parked, ParkedPoll) and parked.request_id == request_id and parked.tenant == tenant:
        return parked
    return None


class LongPolls:
    """ASGI middleware: parks `POST <path>` (retrieve_future) until its future ended, then passes it on."""

    def __init__(self, app: App, *, ctx: ApiContext, path: str, answer_ended: bool = True) -> None:
        self.app = app
        self.ctx = ctx
        self.path = path
        self.answer_ended = answer_ended  # False where telemetry links each poll's span to its op's trace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        first = await receive()
        if first["type"] != "http.request" or first.get("more_body", False):
            # The client went away, or the body streams (api.body_limit hands JSON bodies over whole): the route
            # reads it as it comes.
            await self.app(scope, replay([first], receive), send)
            return
        poll = self._poll_of(scope, first.get("body", b""))
        if poll is not None:
            request_id, tenant = poll
            deadline = time.monotonic() + self.ctx.long_poll_seconds
            record: FutureRecord | None
            try:
                record = await await_future(self.ctx, request_id, tenant, self.ctx.long_poll_seconds)
            except Exception:  # noqa: BLE001 - the route meets the same error and answers it
                record = None
            if record is not None and self.answer_ended and await self._answer_ended(scope, send, record, tenant):
                return
            scope.setdefault("state", {})[STATE_KEY] = ParkedPoll(request_id, tenant, record, deadline)
        await self.app(scope, replay([first], receive), send)

    def _poll_of(self, scope: Scope, body: bytes) -> tuple[str, str] | None:
        """(request id, tenant) of a poll the route would accept as it stands, else None."""
        headers = first_headers(scope, b"x-api-key", b"authorization", b"content-type")
        if not is_json(headers.get(b"content-type")):
            return None  # the route would not read it as JSON (or might not): it answers, as it stands
        try:
            key = key_from_headers(headers.get(b"x-api-key"), headers.get(b"authorization"))
            tenant, _ = self.ctx.auth.identify(key)
            request_id = RetrieveFutureBody.model_validate(json.loads(body)).request_id
        except (TwinkleError, ValueError, ValidationError):
            return None
        return request_id, tenant

    async def _answer_ended(self, scope: Scope, send: Send, record: FutureRecord, tenant: str) -> bool:
        """Answer the poll of a future that ended, as the route would (same status, headers and bytes); False,
        answering nothing, for one still pending or a result the broker cannot give now (the route meets the
        same error and answers it)."""
        if record.state is FutureStatus.FAILED:
            body, media_type = finite_json_bytes(failed_answer(record)), JSON
        elif record.state is FutureStatus.COMPLETED:
            try:
                result = await self.ctx.store.result(record.request_id)
            except Exception:  # noqa: BLE001 - see above
                return False
            body, media_type = result_answer(record, result, protobuf=accepts_protobuf(
                first_headers(scope, b"accept").get(b"accept", "")))
        else:
            return False
        scope.setdefault("state", {})["tenant"] = tenant  # for the access log, as the route's auth dependency sets it
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", media_type.encode())]})
        await send({"type": "http.response.body", "body": body})
        return True


def first_headers(scope: Scope, *names: bytes) -> dict[bytes, str]:
    """The first value of each header of `names` the request has, as Starlette's `request.headers.get` reads it."""
    found: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in names and name not in found:
            found[name] = value.decode("latin-1")
    return found


def is_json(content_type: str | None) -> bool:
    """Whether a request's content type is JSON, as FastAPI reads a body parameter."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def replay(messages: Sequence[Message], receive: Receive) -> Receive:
    """`receive` with `messages`, already received, handed out again first (a middleware that read the body
    passes the request on)."""
    pending = list(reversed(messages))

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
