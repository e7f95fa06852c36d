"""Readers for fields of already-parsed JSON objects; every mistake becomes an InvalidRequest."""

from __future__ import annotations

import math
from typing import Any

from twinkle.errors import InvalidRequest


def json_kind(value: Any) -> str:
    """How a JSON value reads in an error message ("a string", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def is_integer(value: Any) -> bool:
    # bool is an int subclass in Python, but `true` is never a valid count or id on the wire.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object, got {json_kind(value)}.")
    return value


def optional_integer(obj: dict[str, Any], key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not is_integer(value):
        raise InvalidRequest(f"{where}.{key} must be an integer, got {json_kind(value)}.")
    return int(value)


def finite_number(obj: dict[str, Any], key: str, default: float, where: str) -> float:
    """The number at `key`, `default` when absent or null; NaN and infinities are refused."""
    value = obj.get(key)
    if value is None:
        return default
    if not is_number(value):
        raise InvalidRequest(f"{where}.{key} must be a number, got {json_kind(value)}.")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequest(f"{where}.{key} must be finite, got {value}.")
    return number


def required_string(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where}.{key} must be a non-empty string, got {json_kind(value)}.")
    return value
