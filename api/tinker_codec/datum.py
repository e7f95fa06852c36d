"""Assembling and checking one training example once its parts are decoded."""

from __future__ import annotations

import numpy as np

from api.tinker_codec.model_input import checked_tokens
from api.tinker_codec.tensors import KEY_DTYPES
from twinkle.errors import InvalidRequest
from twinkle.types import Chunk, Datum, ImageChunk, input_length

# Per-position loss inputs: their first dimension must match the model input's token count.
TOKEN_ALIGNED_KEYS = ("target_tokens", "weights", "advantages", "logprobs")


def checked_datum(
    model_input: list[Chunk], loss_fn_inputs: dict[str, np.ndarray], where: str, *, vocab_size: int | None
) -> Datum:
    length = _known_input_length(model_input)
    checked: dict[str, np.ndarray] = {}
    for key, array in loss_fn_inputs.items():
        at = f"{where}.loss_fn_inputs[{key!r}]"
        array = _with_key_dtype(key, array, at)
        if key == "target_tokens":
            array = checked_tokens(array, at, vocab_size=vocab_size)
        if key in TOKEN_ALIGNED_KEYS and length is not None:
            rows = array.shape[0] if array.ndim else None
            if rows != length:
                raise InvalidRequest(
                    f"{at} has shape {list(array.shape)}, but the model input is {length} tokens long.",
                    hint="target_tokens, weights, advantages and logprobs need one row per input token.",
                )
        checked[key] = array
    return Datum(model_input=model_input, loss_fn_inputs=checked)


def _known_input_length(model_input: list[Chunk]) -> int | None:
    # An image without expected_tokens has a length only the model's processor knows.
    if any(isinstance(c, ImageChunk) and c.expected_tokens is None for c in model_input):
        return None
    return input_length(model_input)


def _with_key_dtype(key: str, array: np.ndarray, where: str) -> np.ndarray:
    wanted = KEY_DTYPES.get(key)
    if wanted is None or array.dtype == wanted:
        return array
    if wanted.kind == "i":
        raise InvalidRequest(f"{where} must be int64 token ids, got {array.dtype} values.")
    return array.astype(wanted)  # integer weights or advantages are harmless; widen them
