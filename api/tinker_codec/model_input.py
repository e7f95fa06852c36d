"""Model input chunks, from the proto `Chunk` list or a JSON `ModelInput`, to Twinkle chunks."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

import numpy as np

from api.tinker_codec.json_fields import as_object, is_integer, json_kind
from twinkle.errors import InvalidRequest
from twinkle.types import Chunk, ImageChunk, TextChunk

IMAGE_FORMATS = ("png", "jpeg")


def chunks_from_proto(msgs: Iterable[Any], where: str, *, vocab_size: int | None = None) -> list[Chunk]:
    chunks: list[Chunk] = []
    for index, msg in enumerate(msgs):
        at = f"{where}.chunks[{index}]"
        kind = msg.WhichOneof("chunk")
        if kind == "encoded_text":
            raw = msg.encoded_text.tokens
            if len(raw) % 4:
                raise InvalidRequest(f"{at} tokens are {len(raw)} bytes, not whole int32 values.")
            tokens = np.frombuffer(raw, dtype="<i4").astype(np.int64)
            chunks.append(TextChunk(checked_tokens(tokens, at, vocab_size=vocab_size)))
        elif kind == "image":
            image = msg.image
            expected = image.expected_tokens if image.HasField("expected_tokens") else None
            chunks.append(_image(image.data, image.format, expected, at))
        elif kind == "dmel":
            raise InvalidRequest(f"{at} is a dmel (audio) chunk, which is not supported.")
        else:
            raise InvalidRequest(f"{at} is empty or of an unknown kind.")
    return checked_not_empty(chunks, where)


def decode_model_input(json_obj: Any, *, vocab_size: int | None = None, where: str = "model_input") -> list[Chunk]:
    """A JSON `ModelInput` ({"chunks": [...]}) as sent in /asample and create requests."""
    chunk_list = as_object(json_obj, where).get("chunks")
    if not isinstance(chunk_list, list):
        raise InvalidRequest(f"{where}.chunks must be a list, got {json_kind(chunk_list)}.")
    chunks: list[Chunk] = []
    for index, value in enumerate(chunk_list):
        at = f"{where}.chunks[{index}]"
        obj = as_object(value, at)
        kind = obj.get("type", "encoded_text" if "tokens" in obj else None)
        if kind == "encoded_text":
            chunks.append(TextChunk(checked_tokens(_json_tokens(obj.get("tokens"), at), at, vocab_size=vocab_size)))
        elif kind == "image":
            chunks.append(_image(_base64(obj.get("data"), at), obj.get("format"), _expected(obj, at), at))
        elif kind == "image_asset_pointer":
            raise InvalidRequest(
                f"{at} is an image_asset_pointer, which this server cannot fetch.",
                hint="Send the image bytes in an 'image' chunk instead.",
            )
        elif kind == "dmel":
            raise InvalidRequest(f"{at} is a dmel (audio) chunk, which is not supported.")
        else:
            raise InvalidRequest(f"{at}.type must be 'encoded_text' or 'image', got {kind!r}.")
    return checked_not_empty(chunks, where)


def checked_tokens(tokens: np.ndarray, where: str, *, vocab_size: int | None) -> np.ndarray:
    """`tokens` if every id is in [0, vocab_size); names the first offender otherwise."""
    if tokens.size == 0:
        return tokens
    bad = tokens < 0 if vocab_size is None else (tokens < 0) | (tokens >= vocab_size)
    if np.any(bad):
        position = int(np.flatnonzero(bad.reshape(-1))[0])
        token = int(tokens.reshape(-1)[position])
        limit = "be >= 0" if vocab_size is None else f"lie in [0, {vocab_size}), the vocabulary"
        raise InvalidRequest(f"{where} holds token id {token} at flat position {position}; ids must {limit}.")
    return tokens


def checked_not_empty(chunks: list[Chunk], where: str) -> list[Chunk]:
    if not any(isinstance(c, ImageChunk) or c.tokens.size for c in chunks):
        raise InvalidRequest(f"{where} is empty; it needs at least one token or image.")
    return chunks


def _image(data: bytes, fmt: Any, expected_tokens: int | None, where: str) -> ImageChunk:
    if not data:
        raise InvalidRequest(f"{where} is an image with no data.")
    if fmt not in IMAGE_FORMATS:
        raise InvalidRequest(f"{where}.format must be one of {list(IMAGE_FORMATS)}, got {fmt!r}.")
    if expected_tokens is not None and expected_tokens <= 0:
        raise InvalidRequest(f"{where}.expected_tokens must be positive, got {expected_tokens}.")
    return ImageChunk(data=bytes(data), format=fmt, expected_tokens=expected_tokens)


def _json_tokens(value: Any, where: str) -> np.ndarray:
    if not isinstance(value, list) or not all(is_integer(t) and -(2**63) <= t < 2**63 for t in value):
        raise InvalidRequest(f"{where}.tokens must be a list of integer token ids.")
    return np.asarray(value, dtype=np.int64).reshape(-1)


def _base64(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.data must be a base64 string, got {json_kind(value)}.")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{where}.data is not valid base64 ({exc}).") from exc


def _expected(obj: dict[str, Any], where: str) -> int | None:
    value = obj.get("expected_tokens")
    if value is None:
        return None
    if not is_integer(value):
        raise InvalidRequest(f"{where}.expected_tokens must be an integer, got {json_kind(value)}.")
    return int(value)
