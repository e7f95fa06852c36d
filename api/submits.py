"""The submits answered before the framework builds a request: POST forward_backward, forward and optim_step,
half of the requests of every Tinker SDK step (the other half are its polls, api/long_poll.py), and asample, the
submit of every SDK sample.

Through FastAPI each submit paid for routing, dependency solving, the body's validation and the exception and
exit-stack middlewares: about a fifth of the API's CPU on a training step, as much again as the submit's own
work, and 0.3 ms of an SDK sample's 1.0 ms in the API (profiled in the README's Benchmarks). `Submits` does
what the route does, with the same service calls (`api.tinker_submits`): it identifies the caller, reads the
body (optim_step's and asample's JSON validated by the route's own model), submits, and answers the route's
body (`{"request_id", "model_id"}`, or asample's `{"request_id", "sample_sequence_ids"}`) with the bytes and
headers the route sends. An error the submit raises is answered by the app's own error answers
(`api.errors.ErrorAnswers`: the same status, headers, body and tarpit).

A request it cannot read as the route would accept it goes to the app untouched, before anything happened: no
key or an unknown one, an optim_step or asample body that is not JSON or does not validate, a body over the
limit, a client that went away. The app then answers it exactly as before (401, 400, 413, ...). With telemetry
on, every request goes through the framework, whose instrumentation traces each route.
"""

from __future__ import annotations

import json
from collections.abc import Coroutine
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from api import tinker_submits
from api.context import ApiContext
from api.errors import ErrorAnswers
from api.finite_json import finite_json_bytes
from api.long_poll import App, Message, Receive, Scope, Send, first_headers, is_json, replay
from api.responses.tinker import future_handle
from api.schemas import Body, OptimStepBody, SampleBody
from twinkle.auth import key_from_headers
from twinkle.errors import TwinkleError
from twinkle.records import ModelRecord

ROUTES = ("forward_backward", "forward", "optim_step", "asample")
JSON_BODIES: dict[str, type[Body]] = {"optim_step": OptimStepBody, "asample": SampleBody}  # read as the routes do
JSON = b"application/json"


class Submits:
    """ASGI middleware: answers POST `<prefix>/forward_backward`, `/forward`, `/optim_step` and `/asample` itself."""

    def __init__(self, app: App, *, ctx: ApiContext, prefix: str, errors: ErrorAnswers, enabled: bool = True) -> None:
        self.app = app
        self.ctx = ctx
        self.errors = errors
        self.routes = {f"{prefix}/{route}": route for route in ROUTES} if enabled else {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        received: list[Message] = []
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":  # the client went away: the app sees it as it would have
                await self.app(scope, replay(received, receive), send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(message.get("body", b"") for message in received)
        submit = self._submit_of(scope, route, body)
        if submit is None:
            await self.app(scope, replay([{"type": "http.request", "body": body, "more_body": False}], receive),
                           send)
            return
        try:
            answered = await submit
        except Exception as exc:  # noqa: BLE001 - answered as the app answers a route that raised it
            answer = await self.errors.answer(Request(scope), exc)
            await answer(scope, receive, send)
            return
        content = finite_json_bytes(answered)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(content)).encode()), (b"content-type", JSON)]})
        await send({"type": "http.response.body", "body": content})

    def _submit_of(self, scope: Scope, route: str, body: bytes) -> Coroutine[Any, Any, dict[str, Any]] | None:
        """The submit the route would make of this request, answering the route's body, not begun yet; None where
        the route would answer otherwise."""
        headers = first_headers(scope, b"x-api-key", b"authorization", b"content-type", b"content-encoding")
        if len(body) > self.ctx.max_request_bytes:
            return None
        try:
            tenant, policy = self.ctx.auth.identify(key_from_headers(headers.get(b"x-api-key"),
                                                                     headers.get(b"authorization")))
        except TwinkleError:
            return None
        parsed = None
        model = JSON_BODIES.get(route)
        if model is not None:
            if not is_json(headers.get(b"content-type")):
                return None  # FastAPI reads other media types in ways of its own: the route answers them
            try:
                parsed = model.model_validate(json.loads(body))
            except (ValueError, ValidationError):
                return None
        state = scope.setdefault("state", {})
        state["tenant"], state["policy"] = tenant, policy  # as the route's auth dependency sets them
        if isinstance(parsed, SampleBody):
            return tinker_submits.asample(self.ctx, tenant, policy, parsed)
        if isinstance(parsed, OptimStepBody):
            return _handle(tinker_submits.optim_step(self.ctx, tenant, policy, parsed))
        return _handle(tinker_submits.forward_backward(
            self.ctx, tenant, policy, body, headers.get(b"content-type") or "", headers.get(b"content-encoding"),
            forward_only=route == "forward"))


async def _handle(submit: Coroutine[Any, Any, tuple[ModelRecord, str]]) -> dict[str, Any]:
    """A training submit's answer: the future's handle."""
    record, request_id = await submit
    return future_handle(request_id, record.model_id)
