"""`/forward_backward` and `/forward` request bodies: the 0.38 protobuf and the 0.16 JSON shape."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import google.protobuf.message

from api.json_depth import check_json_depth
from api.provenance import Span, spans_from_proto
from api.tinker_codec import wire_schema as pb
from api.tinker_codec.datum import checked_datum
from api.tinker_codec.json_fields import as_object, is_number, json_kind, optional_integer, required_string
from api.tinker_codec.model_input import chunks_from_proto, decode_model_input
from api.tinker_codec.request_body import decoded_body
from api.tinker_codec.tensors import tensor_from_json, tensor_from_proto
from twinkle.errors import InvalidRequest
from twinkle.types import Datum, ForwardBackwardInput

PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
JSON_TYPE = "application/json"


@dataclass(frozen=True)
class ForwardBackwardRequestMeta:
    """Routing facts of a fwd/bwd request; `seq_id` None when the client sent none (proto: 0)."""

    model_id: str
    seq_id: int | None
    forward_only: bool
    # per datum, its loss_fn_input_spans (Datum.with_provenance), None where it has none
    provenance: tuple[tuple[Span, ...] | None, ...] = ()


def decode_forward_backward(
    body: bytes,
    content_type: str,
    content_encoding: str | None,
    *,
    max_bytes: int,
    vocab_size: int | None = None,
) -> tuple[ForwardBackwardRequestMeta, ForwardBackwardInput, bool]:
    """Decode and validate a fwd/bwd request body.

    Returns the routing facts, the batch, and whether the request came as protobuf: a protobuf client
    (SDK 0.38) must get its result as protobuf, a JSON client (SDK 0.16) as JSON.
    """
    raw = decoded_body(body, content_encoding, max_bytes=max_bytes)
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in PROTOBUF_TYPES:
        meta, batch = _from_proto(raw, max_bytes=max_bytes, vocab_size=vocab_size)
        return meta, batch, True
    if media_type == JSON_TYPE:
        meta, batch = _from_json(raw, max_bytes=max_bytes, vocab_size=vocab_size)
        return meta, batch, False
    raise InvalidRequest(
        f"Content-Type {content_type!r} is not supported for forward_backward.",
        hint="Send application/x-protobuf (tinker_public.ForwardBackwardRequest) or application/json.",
    )


def _from_proto(
    raw: bytes, *, max_bytes: int, vocab_size: int | None
) -> tuple[ForwardBackwardRequestMeta, ForwardBackwardInput]:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except google.protobuf.message.DecodeError as exc:
        raise InvalidRequest(f"The body is not a valid tinker_public.ForwardBackwardRequest: {exc}.") from exc
    if not msg.model_id:
        raise InvalidRequest("model_id is required.")
    if msg.seq_id < 0:
        raise InvalidRequest(f"seq_id must not be negative, got {msg.seq_id}.")
    data: list[Datum] = []
    for index, datum_msg in enumerate(msg.data):
        where = f"data[{index}]"
        chunks = chunks_from_proto(datum_msg.model_input, f"{where}.model_input", vocab_size=vocab_size)
        inputs = {
            key: tensor_from_proto(tensor, f"{where}.loss_fn_inputs[{key!r}]", max_bytes=max_bytes)
            for key, tensor in sorted(datum_msg.loss_fn_inputs.items())
        }
        data.append(checked_datum(chunks, inputs, where, vocab_size=vocab_size))
    config: dict[str, float | str] = {}
    for key, number in msg.loss_fn_config.items():
        config[key] = _finite_config_number(key, number)
    for key, value in msg.loss_fn_config_v2.items():  # v2 carries strings too, and wins where both are set
        kind = value.WhichOneof("value")
        if kind == "number":
            config[key] = _finite_config_number(key, value.number)
        elif kind == "text":
            config[key] = value.text
        else:
            raise InvalidRequest(f"loss_fn_config_v2[{key!r}] has neither a number nor a text value.")
    provenance = tuple(spans_from_proto(datum_msg.loss_fn_input_spans, f"data[{index}].loss_fn_input_spans")
                       for index, datum_msg in enumerate(msg.data))
    meta = ForwardBackwardRequestMeta(msg.model_id, msg.seq_id or None, msg.forward_only, provenance)
    return meta, _batch(data, msg.loss_fn, config)


def _from_json(
    raw: bytes, *, max_bytes: int, vocab_size: int | None
) -> tuple[ForwardBackwardRequestMeta, ForwardBackwardInput]:
    check_json_depth(raw)  # a zstd body was not visible to the check in api.body_limit
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}.") from exc
    body = as_object(parsed, "The request body")
    has_fwdbwd, has_fwd = "forward_backward_input" in body, "forward_input" in body
    if has_fwdbwd == has_fwd:
        raise InvalidRequest("The body must hold exactly one of forward_backward_input and forward_input.")
    input_key = "forward_input" if has_fwd else "forward_backward_input"
    seq_id = optional_integer(body, "seq_id", "body")
    if seq_id is not None and seq_id < 0:
        raise InvalidRequest(f"seq_id must not be negative, got {seq_id}.")
    meta = ForwardBackwardRequestMeta(required_string(body, "model_id", "body"), seq_id, has_fwd)
    fb_input = as_object(body[input_key], input_key)
    datums = fb_input.get("data")
    if not isinstance(datums, list):
        raise InvalidRequest(f"{input_key}.data must be a list of datums, got {json_kind(datums)}.")
    data: list[Datum] = []
    for index, value in enumerate(datums):
        where = f"data[{index}]"
        datum_obj = as_object(value, where)
        chunks = decode_model_input(datum_obj.get("model_input"), vocab_size=vocab_size, where=f"{where}.model_input")
        inputs_obj = as_object(datum_obj.get("loss_fn_inputs", {}), f"{where}.loss_fn_inputs")
        inputs = {
            key: tensor_from_json(tensor, key, f"{where}.loss_fn_inputs[{key!r}]", max_bytes=max_bytes)
            for key, tensor in sorted(inputs_obj.items())
        }
        data.append(checked_datum(chunks, inputs, where, vocab_size=vocab_size))
    config_obj = fb_input.get("loss_fn_config")
    config: dict[str, float | str] = {}
    for key, item in as_object({} if config_obj is None else config_obj, "loss_fn_config").items():
        if isinstance(item, str):
            config[key] = item
        elif is_number(item):
            config[key] = _finite_config_number(key, float(item))
        else:
            raise InvalidRequest(f"loss_fn_config[{key!r}] must be a number or a string, got {json_kind(item)}.")
    loss_fn = fb_input.get("loss_fn")
    return meta, _batch(data, loss_fn if isinstance(loss_fn, str) else "", config)


def _batch(data: list[Datum], loss_fn: str, config: dict[str, float | str]) -> ForwardBackwardInput:
    if not data:
        raise InvalidRequest("The batch is empty; send at least one datum.")
    if not loss_fn:
        raise InvalidRequest("loss_fn is required (for example 'cross_entropy').")
    return ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config)


def _finite_config_number(key: str, number: float) -> float:
    if not math.isfinite(number):
        raise InvalidRequest(f"loss_fn_config[{key!r}] must be finite, got {number}.")
    return number
