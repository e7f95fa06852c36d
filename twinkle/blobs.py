"""Payloads of requests and results, stored in Redis as blobs next to their future.

Blobs are written and read only by Twinkle's own processes (the API writes inputs after validating
them; workers write results), never taken from clients, so Python pickles of the compute types in
`twinkle.types` are safe here and keep numpy arrays as raw bytes.
"""

from __future__ import annotations

import pickle
from typing import Any

from twinkle.errors import InvalidRequest


def dumps(value: Any) -> bytes:
    # The pickler recurses once per nesting level, bounded by the interpreter's recursion limit; the API
    # refuses JSON nested deeper than 64 levels, so reaching that limit means a payload built elsewhere.
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except RecursionError as exc:
        raise InvalidRequest("The payload nests too deeply to be stored.",
                             hint="Flatten the nested lists and objects of the request.") from exc


def loads(data: bytes) -> Any:
    return pickle.loads(data)  # written by Twinkle processes only, see module docstring
