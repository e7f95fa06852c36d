"""One place that turns exceptions into JSON answers: a message that says what to do, a request id,
never a traceback or a server path."""

from __future__ import annotations

import logging
import math
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.redis_client import BROKER_ERRORS
from api.tarpit import Tarpit
from api.unsupported import describe_missing_route
from twinkle.checkpoints import storage_failure
from twinkle.errors import BrokerUnavailable, RateLimited, TwinkleError

log = logging.getLogger("twinkle.api")
BROKER_RETRY_AFTER_SECONDS = 2  # a Redis restart takes a few seconds


def request_id_of(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        request.state.request_id = rid
    return str(rid)


def error_response(request: Request, exc: TwinkleError) -> JSONResponse:
    body = exc.to_dict()
    body["request_id"] = request_id_of(request)
    headers = {"x-request-id": body["request_id"]}
    if isinstance(exc, RateLimited):
        retry_after = float(exc.details.get("retry_after", 1))
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        headers["Retry-After-Ms"] = str(max(1, math.ceil(retry_after * 1000)))  # the Tinker SDK reads it first
    if isinstance(exc, BrokerUnavailable):
        headers["Retry-After"] = str(BROKER_RETRY_AFTER_SECONDS)
    if exc.status_code >= 500 or exc.status_code in (429,):
        headers.setdefault("x-should-retry", "true")
    elif exc.status_code < 500:
        headers["x-should-retry"] = "false"
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


class ErrorAnswers:
    """The answers to a route's exceptions, shared by the app's handlers and the middleware that answers the
    training submits without the framework (api/submits.py): one tarpit for both."""

    def __init__(self) -> None:
        self.tarpit = Tarpit()

    async def twinkle(self, request: Request, exc: TwinkleError) -> JSONResponse:
        tenant = getattr(request.state, "tenant", None)
        if isinstance(exc, RateLimited) and tenant:
            exc.details["retry_after"] = await self.tarpit.refuse(tenant, float(exc.details.get("retry_after", 1)))
        return error_response(request, exc)

    async def broker_down(self, request: Request, exc: Exception) -> JSONResponse:
        log.warning("broker unreachable in %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(request, BrokerUnavailable(
            "The server's queue (Redis) is unreachable.", hint="Retry in a few seconds."))

    async def unexpected(self, request: Request, exc: Exception) -> JSONResponse:
        failure = storage_failure(exc)  # a full or read-only checkpoint disk is the operator's, and says so
        if failure is not None:
            log.error("checkpoint storage failed in %s %s: %s", request.method, request.url.path, exc)
            return error_response(request, failure)
        rid = request_id_of(request)
        log.exception("unhandled error in %s %s (request %s)", request.method, request.url.path, rid)
        return JSONResponse({"error": f"Internal server error. Report request id {rid} to the operator.",
                             "category": "server", "code": "internal_error", "request_id": rid},
                            status_code=500, headers={"x-request-id": rid})

    async def answer(self, request: Request, exc: Exception) -> JSONResponse:
        """What the app answers a route that raised `exc` (a TwinkleError, a broker error, anything else)."""
        if isinstance(exc, TwinkleError):
            return await self.twinkle(request, exc)
        if isinstance(exc, BROKER_ERRORS):
            return await self.broker_down(request, exc)
        return await self.unexpected(request, exc)


def install(app: FastAPI) -> ErrorAnswers:
    answers = ErrorAnswers()
    app.add_exception_handler(TwinkleError, answers.twinkle)  # type: ignore[arg-type]
    for broker_error in BROKER_ERRORS:
        app.add_exception_handler(broker_error, answers.broker_down)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:20]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        rid = request_id_of(request)
        return JSONResponse(
            {"error": "Invalid request: " + "; ".join(problems) + ". Fix these fields and resend.",
             "category": "user", "code": "invalid_request", "request_id": rid},
            status_code=400, headers={"x-request-id": rid, "x-should-retry": "false"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        rid = request_id_of(request)
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        code = f"http_{exc.status_code}"
        if exc.status_code == 404 and message == "Not Found":  # no route matched, not a NotFound of ours
            code, message = describe_missing_route(request.method, request.url.path)
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{request.method} {request.url.path} is not accepted here; this route takes {allowed}."
        return JSONResponse({"error": message, "category": "user", "code": code,
                             "request_id": rid}, status_code=exc.status_code,
                            headers={"x-request-id": rid, "x-should-retry": "false", **(exc.headers or {})})

    app.add_exception_handler(Exception, answers.unexpected)
    return answers
