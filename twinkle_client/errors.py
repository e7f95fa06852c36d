"""Every error twinkle_client raises on purpose.

    TwinkleClientError                root; catch this to catch everything below
    ├── InvalidArgument               the call is wrong before anything is sent (also a ValueError)
    ├── ConnectionFailed              no answer from the server, after the retries allowed
    ├── FutureTimeout                 result(timeout=...) or encode(timeout=...) ran out (also a TimeoutError)
    ├── RequestFailed                 the server ran the request and it failed (category "user" or "server")
    └── APIError                      the server answered with an HTTP error status
        ├── BadRequestError           400, 422
        ├── AuthenticationError       401, 403
        ├── QuotaExceededError        403 with code quota_exceeded: a quota of the key's tier is used up
        ├── NotFoundError             404
        ├── ConflictError             409
        ├── GoneError                 410: expired futures and resources
        ├── PayloadTooLargeError      413
        ├── RateLimitError            429, raised once the retries are used up
        └── InternalServerError       5xx

Messages carry the server's own message (which says what to do) and its request id. Every error pickles
with its fields, so it survives multiprocessing and executors.
"""

from __future__ import annotations

from typing import Any


class TwinkleClientError(Exception):
    """Raised for any failure twinkle_client reports."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class InvalidArgument(TwinkleClientError, ValueError):
    """Raised when a call cannot be sent as given; the message says what to pass instead."""


class ConnectionFailed(TwinkleClientError):
    """Raised when the server cannot be reached or does not answer in time."""


class FutureTimeout(TwinkleClientError, TimeoutError):
    """Raised when waiting for a result runs out of time; the request may still finish on the server."""


class RequestFailed(TwinkleClientError):
    """Raised by TwinkleFuture.result() when the server ran the request and it failed.

    `category` is "user" when resubmitting the same request would fail again (fix the input first) and
    "server" when the server was at fault.
    """

    def __init__(
        self, category: str, message: str, request_id: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.category = category
        self.request_id = request_id
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.category, self.message, self.request_id, self.code))

    def __str__(self) -> str:
        suffix = f" (request {self.request_id})" if self.request_id else ""
        return f"{self.category} error: {self.message}{suffix}"


class APIError(TwinkleClientError):
    """Raised when the server answers with an HTTP error; `status` is the HTTP status code."""

    def __init__(
        self,
        status: int,
        message: str,
        request_id: str | None = None,
        code: str | None = None,
        category: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.request_id = request_id
        self.code = code
        self.category = category

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.message, self.request_id, self.code, self.category))

    def __str__(self) -> str:
        suffix = f" (request {self.request_id})" if self.request_id else ""
        return f"HTTP {self.status}: {self.message}{suffix}"


class BadRequestError(APIError):
    """Raised for 400 and 422: the request was malformed or out of range."""


class AuthenticationError(APIError):
    """Raised for 401 and 403: the API key is missing or not accepted."""


class QuotaExceededError(APIError):
    """Raised when a quota of the API key's tier is used up (tokens, pool time, checkpoint bytes per day,
    month or ever, or active training runs). Never retried: the message names the quantity, what was used,
    the limit and when it resets; wait until then or ask the server operator for a higher quota."""


class NotFoundError(APIError):
    """Raised for 404: an unknown id, or one that belongs to another API key."""


class ConflictError(APIError):
    """Raised for 409: the request conflicts with the resource's current state."""


class GoneError(APIError):
    """Raised for 410: the future or resource existed but has expired."""


class PayloadTooLargeError(APIError):
    """Raised for 413: the request body is over the server's limit; send smaller batches."""


class RateLimitError(APIError):
    """Raised for 429 once the client's retries are used up."""


class InternalServerError(APIError):
    """Raised for 5xx: the server failed."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    413: PayloadTooLargeError,
    422: BadRequestError,
    429: RateLimitError,
}

_BY_CODE: dict[str, type[APIError]] = {"quota_exceeded": QuotaExceededError}


def api_error(
    status: int,
    message: str,
    request_id: str | None = None,
    code: str | None = None,
    category: str | None = None,
) -> APIError:
    """The APIError subclass that matches `code`, else `status`."""
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status) or (InternalServerError if status >= 500 else APIError)
    return cls(status, message, request_id, code, category)
