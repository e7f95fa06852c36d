"""JSON answers that survive NaN and infinities.

A diverged adapter (a learning rate that was too high) reports NaN losses, gradient norms and logprobs.
Standard JSON has no token for them: Starlette refuses to encode them (a 500, which the Tinker SDK
retries forever) and the SDK's parser (orjson) refuses the `NaN` literal Python would write. So every
non-finite float goes out as the string "NaN", "Infinity" or "-Infinity": the SDK's pydantic types and
`twinkle_client` read those strings back as the float they stand for, and the user sees the divergence.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

_NAMES = {math.inf: "Infinity", -math.inf: "-Infinity"}


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by its JSON-safe string."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else _NAMES[value]
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def finite_json_bytes(content: Any) -> bytes:
    """`content` written as Starlette's JSONResponse writes it, non-finite floats as their strings."""
    try:
        return _json_bytes(content)
    except ValueError:  # "Out of range float values are not JSON compliant": the rare slow path
        return _json_bytes(finite_json(content))


def _json_bytes(content: Any) -> bytes:
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return finite_json_bytes(content)
