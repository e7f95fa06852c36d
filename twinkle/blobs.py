"""Payloads of requests and results, stored in Redis as blobs next to their future.

Blobs are written and read only by Twinkle's own processes (the API writes inputs after validating
them; workers write results), never taken from clients, so Python pickles of the compute types in
`twinkle.types` are safe here and keep numpy arrays as raw bytes.
"""

from __future__ import annotations

import pickle
from typing import Any


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)  # written by Twinkle processes only, see module docstring
