"""`init_tinker_client()`: point the unmodified Tinker SDK (0.38) at a Twinkle server.

Against Twinkle the SDK needs no patch at all when the key starts with `tml-` and paths use
`tinker://`. This adds only the conveniences the seed documents, each a thin wrapper that defers to
the SDK's own code:

- `TWINKLE_SERVER_URL` becomes the default base URL and `TWINKLE_SERVER_TOKEN` the default key;
- keys without the `tml-` prefix are accepted (Twinkle keys are free-form);
- `twinkle://` checkpoint paths are accepted wherever the SDK parses `tinker://` paths;
- `get_tokenizer()` loads the tokenizer files the server serves (twinkle.tokenizer_cache) before it
  tries the hub, so a client machine without hub access gets the server's tokenizer.
"""

from __future__ import annotations

import functools
import math
import os
from contextvars import ContextVar
from typing import Any

TWINKLE_SCHEME = "twinkle://"
_PATCHED = False


def as_tinker_path(path: Any) -> Any:
    if isinstance(path, str) and path.startswith(TWINKLE_SCHEME):
        return "tinker://" + path[len(TWINKLE_SCHEME) :]
    return path


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> None:
    """Patch the installed Tinker SDK once; call it before creating a ServiceClient."""
    global _PATCHED
    url = base_url or os.environ.get("TWINKLE_SERVER_URL")
    if url and not os.environ.get("TINKER_BASE_URL"):
        os.environ["TINKER_BASE_URL"] = url.rstrip("/").removesuffix("/api/v1")
    key = api_key or os.environ.get("TWINKLE_SERVER_TOKEN")
    if key and not os.environ.get("TINKER_API_KEY"):
        os.environ["TINKER_API_KEY"] = key
    if _PATCHED:
        return
    _accept_any_key()
    _accept_twinkle_paths()
    _load_served_tokenizers()
    _PATCHED = True


def _accept_any_key() -> None:
    from tinker.lib import _auth_token_provider as auth

    original = auth.ApiKeyAuthProvider.__init__

    @functools.wraps(original)
    def __init__(self: Any, api_key: str) -> None:
        if api_key.startswith(("tml-", "eyJ")):
            original(self, api_key)
        else:
            self._token = api_key
            self._expires_at = math.inf

    auth.ApiKeyAuthProvider.__init__ = __init__  # type: ignore[method-assign]


def _accept_twinkle_paths() -> None:
    from tinker.lib.internal_client_holder import InternalClientHolder
    from tinker.types.checkpoint import ParsedCheckpointTinkerPath

    parse = ParsedCheckpointTinkerPath.from_tinker_path.__func__  # type: ignore[attr-defined]

    def from_tinker_path(cls: Any, tinker_path: str) -> Any:
        return parse(cls, as_tinker_path(tinker_path))

    ParsedCheckpointTinkerPath.from_tinker_path = classmethod(from_tinker_path)  # type: ignore[assignment]

    create = InternalClientHolder._create_sampling_session

    @functools.wraps(create)
    async def _create_sampling_session(self: Any, model_path: str | None = None,
                                       base_model: str | None = None) -> str:
        return await create(self, as_tinker_path(model_path), base_model)

    InternalClientHolder._create_sampling_session = _create_sampling_session  # type: ignore[method-assign]


# The server of the client whose get_tokenizer() is running: the SDK's loader is a module-level function.
_TOKENIZER_SERVER: ContextVar[tuple[str, str | None] | None] = ContextVar("twinkle_tokenizer_server", default=None)


def _load_served_tokenizers() -> None:
    from tinker.lib.public_interfaces import sampling_client, training_client

    original = sampling_client._load_tokenizer_from_model_info

    @functools.lru_cache(maxsize=32)
    def from_server(model_name: str, tokenizer_id: str | None, server: tuple[str, str | None] | None) -> Any:
        from twinkle.tokenizer_cache import fetch_tokenizer_files

        wanted = tokenizer_id or model_name.split(":")[0]
        if not os.path.isdir(wanted):  # a directory on this machine (client and server share it) loads as is
            base_url, api_key = server or (None, None)
            directory = fetch_tokenizer_files(wanted, base_url=base_url, api_key=api_key)
            if directory is not None:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(directory)
        return original(model_name, tokenizer_id)

    def load(model_name: str, tokenizer_id: str | None = None) -> Any:
        return from_server(model_name, tokenizer_id, _TOKENIZER_SERVER.get())

    sampling_client._load_tokenizer_from_model_info = load  # type: ignore[assignment]
    training_client._load_tokenizer_from_model_info = load  # type: ignore[assignment]
    for cls in (sampling_client.SamplingClient, training_client.TrainingClient):
        cls.get_tokenizer = _with_server(cls.get_tokenizer)  # type: ignore[method-assign]


def _with_server(get_tokenizer: Any) -> Any:
    @functools.wraps(get_tokenizer)
    def wrapper(self: Any) -> Any:
        holder = getattr(self, "holder", None)
        base_url = getattr(holder, "_base_url", None)
        token = _TOKENIZER_SERVER.set((base_url, getattr(holder, "_api_key", None)) if base_url else None)
        try:
            return get_tokenizer(self)
        finally:
            _TOKENIZER_SERVER.reset(token)

    return wrapper
