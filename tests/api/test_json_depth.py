"""The nesting-depth scan that runs before any JSON parser: exact at the limit, blind to brackets in strings."""

from __future__ import annotations

import json

import pytest

from api.json_depth import MAX_JSON_DEPTH, check_json_depth, nests_deeper_than
from twinkle.errors import InvalidRequest


def nested(levels: int, inner: str = "") -> bytes:
    text = inner
    for level in range(levels):
        text = f"[{text}]" if level % 2 else f'{{"k": {text or "1"}}}'
    return text.encode()


@pytest.mark.parametrize("levels", [1, 2, 10, MAX_JSON_DEPTH])
def test_bodies_up_to_the_limit_pass(levels: int) -> None:
    body = nested(levels)
    json.loads(body)
    assert not nests_deeper_than(body)


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 1000, 10_000])
def test_bodies_past_the_limit_are_caught(levels: int) -> None:
    assert nests_deeper_than(nested(levels))
    with pytest.raises(InvalidRequest, match="nests deeper than 64 levels"):
        check_json_depth(b"[" * levels + b"]" * levels)


def test_brackets_inside_strings_do_not_count() -> None:
    body = json.dumps({"text": "[" * 500 + "{" * 500, "escaped": '\\"[[[[' * 100, "quote": '"' * 50}).encode()
    assert not nests_deeper_than(body)
    assert nests_deeper_than(json.dumps({"t": '"]]]]\\'}).encode() + b"[" * 100 + b"]" * 100)


def test_a_wide_flat_body_is_not_deep() -> None:
    assert not nests_deeper_than(b"[" + b"[1],{}," * 100_000 + b"[]]")


def test_malformed_bodies_are_left_to_the_parser() -> None:
    assert not nests_deeper_than(b"]]]]" * 100)
    assert not nests_deeper_than(b'["unterminated' + b"[" * 100)
