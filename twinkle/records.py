"""Records kept in Redis hashes: sessions, models (training runs), sampling sessions.

Each record is a dataclass of flat fields; dict and list fields are stored as JSON strings.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Self


class HashRecord:
    """Round-trips a flat dataclass through a Redis hash."""

    def to_hash(self) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, bool):
                out[f.name] = int(value)
            elif isinstance(value, (dict, list)):
                out[f.name] = json.dumps(value)
            elif value is None:
                out[f.name] = ""
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> Self:
        parsers = _parsers(cls)  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            name = key.decode() if isinstance(key, bytes) else key
            parse = parsers.get(name)
            if parse is not None:  # a field this record no longer has is ignored
                kwargs[name] = parse(value.decode() if isinstance(value, bytes) else value)
        return cls(**kwargs)


@functools.cache
def _parsers(cls: type) -> dict[str, Callable[[str], Any]]:
    """Each field's parser, from its type: resolved once per class (string annotations cost milliseconds to
    resolve, and every request reads a record or two)."""
    hints = typing.get_type_hints(cls)
    return {f.name: _parser(hints[f.name]) for f in fields(cls)}


def _parser(hint: Any) -> Callable[[str], Any]:
    if hint is bool:
        return lambda value: value not in ("", "0", "False", "false")
    if hint is int:
        return lambda value: int(float(value)) if value else 0
    if hint is float:
        return lambda value: float(value) if value else 0.0
    origin = typing.get_origin(hint)
    if origin in (dict, list):
        return lambda value: json.loads(value) if value else origin()
    if hint == (str | None):
        return lambda value: value or None
    return str


@dataclass
class SessionRecord(HashRecord):
    session_id: str
    owner: str
    created_at: float
    last_heartbeat: float
    tags: list[str] = field(default_factory=list)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    sdk_version: str = ""
    finished: str = ""  # finish reason once the client closed the session
    model_seq: int = 0


@dataclass
class ModelRecord(HashRecord):
    """A training client's adapter; it doubles as the training run of the RestClient."""

    model_id: str
    owner: str
    session_id: str
    base_model: str
    app: str  # model application name
    queue: str  # pool queue it is pinned to
    lora: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    last_request_at: float = 0.0
    status: str = "active"  # active | unloaded
    unload_reason: str = ""
    last_checkpoint: str = ""  # tinker:// path of the newest training checkpoint
    last_sampler_checkpoint: str = ""
    user_metadata: dict[str, Any] = field(default_factory=dict)
    ops_executed: int = 0  # incremented by the pool as each op starts
    steps: int = 0  # optimizer steps taken, counted by twinkle.run_metrics as each one finishes


@dataclass
class SamplingSessionRecord(HashRecord):
    sampling_session_id: str
    owner: str
    session_id: str
    base_model: str
    queue: str
    model_path: str = ""  # tinker:// path of sampler weights ("" = base model)
    created_at: float = 0.0
