"""Inputs as JSON: InputFeatures (dicts of numpy arrays) and Trajectories, the way the server reads them.

    token arrays (input_ids, labels, attention_mask)   lists of ints
    other 1-D arrays (advantages, old_logps, ...)      lists of numbers
    arrays of 2 or more dimensions (pixel_values)      {"npy": base64 of the .npy file}, as in
                                                       twinkle.data_format.input_feature_to_row
    Trajectories (pydantic) and Messages               model_dump(mode="json")

Torch tensors and other array types with a `tolist()` are accepted too, without importing torch here.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel

from twinkle_client.errors import InvalidArgument

TOKEN_KEYS = ("input_ids", "labels", "attention_mask")


def wire_inputs(inputs: Any) -> list[dict[str, Any]]:
    """A batch (one input or a list of them) as a list of JSON objects."""
    if isinstance(inputs, Mapping | BaseModel):
        inputs = [inputs]
    if isinstance(inputs, str | bytes) or not isinstance(inputs, Sequence):
        raise InvalidArgument(
            f"inputs must be a list of InputFeature dicts or Trajectories, got {type(inputs).__name__}."
        )
    if not inputs:
        raise InvalidArgument("inputs is empty; pass at least one InputFeature or Trajectory.")
    return [wire_input(item) for item in inputs]


def wire_input(item: Any) -> dict[str, Any]:
    if isinstance(item, BaseModel):
        return item.model_dump(mode="json")
    if not isinstance(item, Mapping):
        raise InvalidArgument(
            f"Each input must be an InputFeature dict (input_ids, labels, ...) or a Trajectory, "
            f"got {type(item).__name__}."
        )
    if "messages" not in item and "input_ids" not in item:
        raise InvalidArgument(
            f"An input has neither input_ids nor messages (keys: {sorted(item)}). Encode it with a template, "
            "or pass a Trajectory."
        )
    return {str(key): wire_value(value, token_key=key in TOKEN_KEYS) for key, value in item.items()}


def wire_value(value: Any, token_key: bool = False) -> Any:
    """`value` as JSON; arrays under token keys become int lists."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if token_key:
        return np.asarray(_as_numpy(value), dtype=np.int64).ravel().tolist()
    if isinstance(value, np.ndarray):
        return {"npy": npy_base64(value)} if value.ndim >= 2 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(key): wire_value(inner) for key, inner in value.items()}
    if isinstance(value, list | tuple):
        return [wire_value(inner) for inner in value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return wire_value(_as_numpy(value))
    return value


def npy_base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # a torch tensor, possibly on a GPU
        value = value.detach().cpu()
    if hasattr(value, "numpy"):
        try:
            return np.asarray(value.numpy())
        except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16) go through Python floats
            pass
    return np.asarray(value.tolist() if hasattr(value, "tolist") else value)
