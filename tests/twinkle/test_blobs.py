"""Payload pickling has a bound: a payload nested past the interpreter's recursion limit is a user error."""

from __future__ import annotations

from typing import Any

import pytest

from twinkle import blobs
from twinkle.errors import InvalidRequest


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_a_payload_at_the_api_depth_limit_round_trips() -> None:
    assert blobs.loads(blobs.dumps({"inputs": nested(64)})) == {"inputs": nested(64)}


def test_a_payload_nested_past_the_recursion_limit_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="nests too deeply"):
        blobs.dumps({"inputs": nested(100_000)})
