"""A cookbook example's connection to its Twinkle server: is one there, which tokenizer it serves, and its
refusals as one line.

Without a server the Tinker SDK retries quietly for minutes, and a wrong model name or API key ends in a
traceback that buries the server's message. Every example therefore calls `require_server(url)` first and runs
under `server_messages()`:

    with server_messages():
        main()
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

API_PREFIX = "/api/v1"
START_HINT = "bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml"  # the Quick start's server
HEALTH_TIMEOUT_SECONDS = 5.0


def require_server(base_url: str) -> None:
    """Exit with one line unless a Twinkle server answers its health check at `base_url`."""
    url = base_url.rstrip("/").removesuffix(API_PREFIX) + API_PREFIX + "/healthz"
    try:
        reply = httpx.get(url, timeout=HEALTH_TIMEOUT_SECONDS)
    except httpx.HTTPError:
        local = httpx.URL(url).host in ("127.0.0.1", "localhost", "::1", "0.0.0.0")
        start = f"start one with `{START_HINT}` (the README's Quick start), or " if local else ""
        raise SystemExit(f"no Twinkle server at {base_url} — {start}point --base-url / TWINKLE_SERVER_URL at a "
                         "running one") from None
    if reply.status_code != 200:
        raise SystemExit(f"{base_url} answered {reply.status_code} to a Twinkle health check "
                         f"({_message_of(reply)}): is it a Twinkle server, and is its broker up?")


def tokenizer_dir(base_url: str, api_key: str, model_name: str) -> str:
    """Where this machine finds the tokenizer of `model_name` for local templates: the server's own tokenizer
    files (downloaded once into the twinkle cache), else the name itself (a hub id the template fetches)."""
    from twinkle.tokenizer_cache import fetch_tokenizer_files

    directory: Path | None = fetch_tokenizer_files(model_name, base_url=base_url, api_key=api_key)
    return str(directory) if directory is not None else model_name


@contextmanager
def server_messages() -> Iterator[None]:
    """Turn the server's refusals (a wrong model name, API key or argument) into its one-line message and exit
    status 1 instead of a traceback."""
    try:
        yield
    except Exception as error:  # the refusals of either client library; anything else is re-raised
        message = _refusal(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1) from None


def _refusal(error: Exception) -> str | None:
    try:
        import tinker
    except ImportError:
        tinker = None  # type: ignore[assignment]
    if tinker is not None:
        if isinstance(error, tinker.APIStatusError):
            body = error.body if isinstance(error.body, dict) else {}
            return f"the server answered {error.status_code}: {body.get('error') or error.message}"
        if isinstance(error, tinker.RequestFailedError):
            # the SDK wraps the server's message: "Request failed: <message> for self.request_id='...' and ..."
            found = re.match(r"Request failed: (.*) for self\.request_id=", error.message, re.DOTALL)
            return f"the server failed the request: {found.group(1) if found else error.message}"
        if isinstance(error, tinker.APIConnectionError):
            return f"lost the connection to the Twinkle server: {error}"
    try:
        from twinkle_client.errors import TwinkleClientError
    except ImportError:
        return None
    if isinstance(error, TwinkleClientError):
        return str(error)
    return None


def _message_of(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:200] or reply.reason_phrase
    return str(body.get("error") or body.get("detail") or body) if isinstance(body, dict) else str(body)[:200]
