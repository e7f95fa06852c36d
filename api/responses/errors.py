"""Error answers, declared once for all routes (api/app.py): Twinkle's shape (api/errors.py) on every route but
the OpenAI-compatible ones, which answer OpenAI's (api/openai/routes.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from api.responses.answer import Answer


class ErrorAnswer(Answer):
    """Every 4xx and 5xx of the Twinkle and Tinker routes. A request's body that fails validation is a 400 of
    this shape (code `invalid_request`), never FastAPI's 422."""

    error: str = Field(description="What went wrong and what to do about it; never a traceback or a server path.")
    category: Literal["user", "server"] = Field(description="`user`: resending it unchanged fails again.")
    code: str = Field(description="A stable name of the error (`invalid_request`, `not_found`, `rate_limited`, ...).")
    request_id: str = Field(description="Also in the `x-request-id` header; name it to the operator.")
    details: dict[str, Any] | None = Field(default=None, description="Machine-readable particulars (`retry_after` "
                                           "seconds of a 429, ...); absent when there are none.")


class OpenAIErrorDetail(Answer):
    message: str
    type: str = Field(description="OpenAI's error type: `invalid_request_error`, `authentication_error`, "
                                  "`not_found_error`, `rate_limit_error`, `insufficient_quota`, `server_error`, ...")
    param: None
    code: str


class OpenAIErrorAnswer(Answer):
    """Every 4xx and 5xx of /v1: OpenAI's shape, which OpenAI clients read the message from."""

    error: OpenAIErrorDetail


def error_responses(model: type[Answer]) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a router whose errors all answer `model`."""
    return {"4XX": {"model": model, "description": "The request cannot be served as sent (see `error`)."},
            "5XX": {"model": model, "description": "The server or its queue failed; retry later."}}


ERROR_RESPONSES = error_responses(ErrorAnswer)
OPENAI_ERROR_RESPONSES = error_responses(OpenAIErrorAnswer)
