"""Transport: one HTTP connection pool to a Twinkle server, with timeouts, retries and error mapping.

Which failures are retried depends on whether repeating the call is safe:

    failure                               idempotent call    submit (POST that starts work)
    connection refused / connect timeout  retry              retry (nothing reached the server)
    read timeout, dropped connection      retry              raise (the work may have started)
    429 Too Many Requests                 retry              retry (refused before any work)
    502 / 503 / 504                       retry              raise
    any other error status                raise              raise

Retries wait for the server's Retry-After when it sends one, else an exponential backoff with jitter.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from twinkle import __version__ as CLIENT_VERSION
from twinkle_client.errors import ConnectionFailed, InvalidArgument, TwinkleClientError, api_error

log = logging.getLogger("twinkle_client")

API_PREFIX = "/api/v1"
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry. `max_retries=0` turns retries off; `sleep` waits between tries."""

    max_retries: int = 5
    backoff_base: float = 0.5
    backoff_max: float = 8.0
    retry_after_max: float = 60.0
    sleep: Callable[[float], None] = time.sleep

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number `attempt + 1`."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.retry_after_max)
        backoff = min(self.backoff_max, self.backoff_base * 2**attempt)
        return backoff * (0.5 + random.random() / 2)  # jitter keeps many clients from retrying in lockstep


NO_RETRIES = RetryPolicy(max_retries=0)


def api_url(base_url: str) -> str:
    """`http://host:port/api/v1` from a base URL given with or without the `/api/v1` suffix."""
    url = base_url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgument(
            f"Not a server URL: {base_url!r}. Pass base_url='http://host:port' (or set TWINKLE_SERVER_URL)."
        )
    return url.removesuffix(API_PREFIX) + API_PREFIX


class Transport:
    """Sends JSON requests to the `/api/v1` routes and returns the JSON replies."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 32,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if timeout <= 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout}.")
        self.api_url = api_url(base_url)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._closed = False
        self._http = httpx.Client(
            base_url=self.api_url,
            headers={
                "X-API-Key": api_key,
                "Authorization": f"Bearer {api_key}",
                "Accept": "application/json",
                "User-Agent": f"twinkle_client/{CLIENT_VERSION}",
            },
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        idempotent: bool | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        content: Callable[[], Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """The decoded JSON reply of `method path`; raises an APIError subclass for error statuses.

        `idempotent` defaults to the method's own semantics (GET, PUT, DELETE are; POST is not). A body other
        than JSON is `content()`, called once per try (bytes, or an iterator of bytes read from a file).
        """
        method = method.upper()
        if idempotent is None:
            idempotent = method in IDEMPOTENT_METHODS
        policy = retry or self.retry
        request_timeout: Any = (
            httpx.USE_CLIENT_DEFAULT
            if timeout is None
            else httpx.Timeout(timeout, connect=min(timeout, 10.0))
        )
        attempt = 0
        while True:
            self._check_open()
            try:
                response = self._http.request(
                    method,
                    path,
                    json=json,
                    params=params,
                    timeout=request_timeout,
                    content=content() if content is not None else None,
                    headers=headers,
                )
            except httpx.TransportError as error:
                self._check_open()
                if not _may_retry_transport_error(error, idempotent) or attempt >= policy.max_retries:
                    raise ConnectionFailed(_transport_message(method, self.api_url + path, error)) from error
                wait = policy.delay(attempt, None)
                log.debug("%s %s failed (%s); retry in %.1f s", method, path, error, wait)
            else:
                if response.is_success:
                    return _json_body(response)
                retryable = response.status_code in RETRYABLE_STATUSES and (
                    idempotent or response.status_code == 429
                )
                if not retryable or attempt >= policy.max_retries:
                    raise _error_from(response)
                wait = policy.delay(attempt, _retry_after(response))
                log.debug("%s %s answered %s; retry in %.1f s", method, path, response.status_code, wait)
            policy.sleep(wait)
            attempt += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._http.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TwinkleClientError(
                "This Twinkle client is closed; create a new one with init_twinkle_client()."
            )


def _may_retry_transport_error(error: httpx.TransportError, idempotent: bool) -> bool:
    if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return True  # the request never left this machine
    return idempotent and isinstance(
        error, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError
    )


def _transport_message(method: str, url: str, error: httpx.TransportError) -> str:
    if isinstance(error, httpx.TimeoutException):
        kind = type(error).__name__
        return f"{method} {url} got no answer in time ({kind}). Is the server overloaded or down?"
    return f"{method} {url} failed: {error or type(error).__name__}. Is the server running at this address?"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None  # an HTTP date; the backoff is a fine substitute


def _json_body(response: httpx.Response) -> Any:
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError:
        raise TwinkleClientError(
            f"{response.request.method} {response.request.url} answered {response.status_code} with a body "
            "that is "
            f"not JSON; is this a Twinkle server?"
        ) from None


def _error_from(response: httpx.Response) -> TwinkleClientError:
    try:
        body = response.json()
    except ValueError:
        body = None
    request_id = response.headers.get("x-request-id")
    if isinstance(body, dict):
        message = body.get("error") or body.get("detail") or body.get("message")
        if not isinstance(message, str):
            message = str(message) if message else response.reason_phrase or "error"
        return api_error(
            response.status_code,
            message,
            request_id=body.get("request_id") or request_id,
            code=body.get("code"),
            category=body.get("category"),
        )
    text = response.text.strip()[:300] or response.reason_phrase or "error"
    return api_error(
        response.status_code,
        f"{response.request.method} {response.request.url.path}: {text}",
        request_id=request_id,
    )
