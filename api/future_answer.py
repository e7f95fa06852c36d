"""The bodies of `retrieve_future`'s answers for a future that ended, rendered in one place for the two places
that send them: the route, and `api.long_poll.LongPolls`, which answers a woken poll itself.

A completed future answers its result: a forward/backward output or a sample as protobuf when the caller
accepts it (the Tinker SDK 0.38 does), else as JSON; any other op's result dict as JSON with its `type` tag. A
failed future answers three fields of its record (200: the poll worked; the op failed). JSON is written as
FastAPI's JSONResponse writes it, non-finite floats as strings (api/finite_json.py).
"""

from __future__ import annotations

from typing import Any

from fastapi.encoders import jsonable_encoder

from api.finite_json import finite_json_bytes
from api.tinker_codec import (
    encode_forward_backward_output,
    encode_sample_output,
    forward_output_json,
    sample_output_json,
)
from twinkle.futures import FutureRecord, Op
from twinkle.types import ForwardBackwardOutput, SampleOutput

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
_TYPE_TAGS: dict[str, str] = {Op.SAVE_STATE: "save_weights", Op.LOAD_STATE: "load_weights"}


def failed_answer(record: FutureRecord) -> dict[str, Any]:
    """What a poll of a failed future answers."""
    return {"error": record.error, "category": record.category or "server", "code": record.code}


def result_answer(record: FutureRecord, result: Any, *, protobuf: bool) -> tuple[bytes, str]:
    """The body and media type of a completed future's answer; `protobuf`: the caller accepts it."""
    if isinstance(result, ForwardBackwardOutput):
        if protobuf:
            return encode_forward_backward_output(result), PROTOBUF
        return finite_json_bytes(forward_output_json(result)), JSON
    if isinstance(result, SampleOutput):
        if protobuf:
            return encode_sample_output(result, result.prompt_length), PROTOBUF
        return finite_json_bytes(sample_output_json(result)), JSON
    body = dict(result or {})
    body.setdefault("type", _TYPE_TAGS.get(record.op, record.op))
    return finite_json_bytes(jsonable_encoder(body)), JSON


def accepts_protobuf(accept: str) -> bool:
    return PROTOBUF in accept
