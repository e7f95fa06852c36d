"""`init_tinker_client()`: point the unmodified Tinker SDK (0.38) at a Twinkle server.

Against Twinkle the SDK needs no patch at all when the key starts with `tml-` and paths use
`tinker://`. This adds only the conveniences the seed documents, each a thin wrapper that defers to
the SDK's own code:

- `TWINKLE_SERVER_URL` becomes the default base URL and `TWINKLE_SERVER_TOKEN` the default key;
- keys without the `tml-` prefix are accepted (Twinkle keys are free-form);
- `twinkle://` checkpoint paths are accepted wherever the SDK parses `tinker://` paths.
"""

from __future__ import annotations

import functools
import math
import os
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
