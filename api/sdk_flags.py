"""The flags `POST /client/config` gives the Tinker SDK (docs/tinker_protocol.md#bootstrap-and-sessions)."""

from __future__ import annotations

import json
import os
from typing import Any

OVERRIDES_ENV = "TWINKLE_TINKER_CLIENT_CONFIG"  # the operator's flags (JSON), over the defaults

# The SDK's own default transport, pyqwest, completes requests on Rust (tokio) threads that call back into Python;
# one that lands while the interpreter finalizes aborts the client's process on Python < 3.14 (`Fatal Python
# error: Aborted` after the script's last line: 4 of 36 cookbook sample.py runs). httpx's own transport has no
# such threads (0 of 48), so Twinkle sends the SDK's documented kill-switch.
DEFAULTS: dict[str, Any] = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False}


def sdk_flags() -> dict[str, Any]:
    """DEFAULTS, with whatever the operator's TWINKLE_TINKER_CLIENT_CONFIG sets over them."""
    return {**DEFAULTS, **json.loads(os.environ.get(OVERRIDES_ENV) or "{}")}
