"""Loss-function input tensors, from the proto `Tensor` or JSON `TensorData`, to dense numpy arrays.

Integer tensors come out int64 and floating ones float32 (the compute types' convention). Sparse CSR
tensors are densified with pad 0, the value the SDK leaves out when it sparsifies.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from api.tinker_codec import wire_schema as pb
from api.tinker_codec.json_fields import as_object, is_integer, json_kind
from twinkle.errors import InvalidRequest, PayloadTooLarge

# How each proto dtype's bytes are laid out; the values are then widened to int64/float32.
_PROTO_WIRE_DTYPES: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}

JSON_DTYPES: dict[str, np.dtype[Any]] = {"int64": np.dtype(np.int64), "float32": np.dtype(np.float32)}

# A plain list carries no dtype; the SDK types it by key (tinker.types.datum._KEY_TO_TYPE).
KEY_DTYPES: dict[str, np.dtype[Any]] = {
    "target_tokens": np.dtype(np.int64),
    "weights": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
    "logprobs": np.dtype(np.float32),
    "clip_low_threshold": np.dtype(np.float32),
    "clip_high_threshold": np.dtype(np.float32),
    "sequence_ratio_mask": np.dtype(np.float32),
}


def tensor_from_proto(msg: Any, where: str, *, max_bytes: int) -> np.ndarray:
    wire = _PROTO_WIRE_DTYPES.get(msg.dtype)
    if wire is None:
        name = next((n for n, v in pb.DTYPES.items() if v == msg.dtype), str(msg.dtype))
        raise InvalidRequest(f"{where} has dtype {name}; send FLOAT32 or INT64.")
    shape = _checked_shape(list(msg.shape), where)
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        csr = msg.sparse_csr
        values = _widened(_from_bytes(csr.values, wire, where, "sparse values"), msg.dtype)
        crow = _from_bytes(csr.crow_indices, np.dtype("<i8"), where, "sparse_crow_indices")
        col = _from_bytes(csr.col_indices, np.dtype("<i8"), where, "sparse_col_indices")
        return _checked_values(_densified(values, shape, crow, col, where, max_bytes=max_bytes), where)
    if encoding is None:
        raise InvalidRequest(f"{where} has neither dense nor sparse_csr data.")
    flat = _widened(_from_bytes(msg.dense, wire, where, "dense data"), msg.dtype)
    return _checked_values(_reshaped(flat, shape, where), where)


def tensor_from_json(value: Any, key: str, where: str, *, max_bytes: int) -> np.ndarray:
    """A JSON `TensorData` object, or a plain (possibly nested) list typed by its key."""
    if isinstance(value, list):
        dtype = KEY_DTYPES.get(key)
        if dtype is None:
            raise InvalidRequest(
                f"{where} is a plain list, but only {sorted(KEY_DTYPES)} may be sent that way.",
                hint='Send {"data": [...], "dtype": "float32" or "int64", "shape": [...]} instead.',
            )
        return _checked_values(_json_numbers(value, dtype, where), where)
    obj = as_object(value, where)
    dtype_name = obj.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in JSON_DTYPES:
        raise InvalidRequest(f"{where}.dtype must be 'int64' or 'float32', got {dtype_name!r}.")
    dtype = JSON_DTYPES[dtype_name]
    data = obj.get("data")
    if not isinstance(data, list):
        raise InvalidRequest(f"{where}.data must be a list of numbers, got {json_kind(data)}.")
    flat = _json_numbers(data, dtype, where).reshape(-1)
    shape_value = obj.get("shape")
    shape = None if shape_value is None else _checked_shape(_json_int_list(shape_value, where, "shape"), where)
    crow_value, col_value = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
    if crow_value is None and col_value is None:
        return _checked_values(_reshaped(flat, shape, where), where)
    if crow_value is None or col_value is None:
        raise InvalidRequest(f"{where} must set sparse_crow_indices and sparse_col_indices together.")
    crow = np.asarray(_json_int_list(crow_value, where, "sparse_crow_indices"), dtype=np.int64)
    col = np.asarray(_json_int_list(col_value, where, "sparse_col_indices"), dtype=np.int64)
    return _checked_values(_densified(flat, shape, crow, col, where, max_bytes=max_bytes), where)


def _from_bytes(raw: bytes, wire: np.dtype[Any], where: str, what: str) -> np.ndarray:
    if len(raw) % wire.itemsize:
        raise InvalidRequest(f"{where} {what} is {len(raw)} bytes, not a whole number of {wire.itemsize}-byte values.")
    return np.frombuffer(raw, dtype=wire)


def _widened(flat: np.ndarray, proto_dtype: int) -> np.ndarray:
    if proto_dtype == pb.DTYPE_BFLOAT16:
        # bfloat16 is the upper half of a float32.
        return (flat.astype(np.uint32) << 16).view(np.float32)
    if flat.dtype.kind == "f":
        return flat.astype(np.float32)
    return flat.astype(np.int64)


def _checked_shape(shape: list[int], where: str) -> list[int] | None:
    if not shape:
        return None  # proto3 cannot tell "no shape" from "[]"; both mean a flat 1-D tensor
    if any(dim < 0 for dim in shape):
        raise InvalidRequest(f"{where} has a negative dimension in shape {shape}.")
    return shape


def _reshaped(flat: np.ndarray, shape: list[int] | None, where: str) -> np.ndarray:
    if shape is None:
        return flat
    if math.prod(shape) != flat.size:
        raise InvalidRequest(f"{where} has {flat.size} values, but shape {shape} needs {math.prod(shape)}.")
    return flat.reshape(shape)


def _densified(
    values: np.ndarray,
    shape: list[int] | None,
    crow: np.ndarray,
    col: np.ndarray,
    where: str,
    *,
    max_bytes: int,
) -> np.ndarray:
    if shape is None or len(shape) != 2:
        raise InvalidRequest(f"{where} is sparse CSR, which needs a 2-D shape; got {shape}.")
    rows, cols = shape
    dense_bytes = rows * cols * values.dtype.itemsize
    if dense_bytes > max_bytes:
        raise PayloadTooLarge(f"{where} densifies to {dense_bytes} bytes; the limit is {max_bytes}.")
    nnz = values.size
    if crow.size != rows + 1:
        raise InvalidRequest(f"{where} has {crow.size} sparse_crow_indices; shape {shape} needs {rows + 1}.")
    if crow[0] != 0 or crow[-1] != nnz or np.any(np.diff(crow) < 0):
        raise InvalidRequest(
            f"{where} sparse_crow_indices must rise from 0 to the value count {nnz} without decreasing."
        )
    if col.size != nnz:
        raise InvalidRequest(f"{where} has {col.size} sparse_col_indices for {nnz} values.")
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise InvalidRequest(f"{where} has a sparse column index outside [0, {cols}).")
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    same_row = row_of[1:] == row_of[:-1]
    if np.any(same_row & (col[1:] <= col[:-1])):
        raise InvalidRequest(f"{where} sparse column indices must strictly increase within each row.")
    dense = np.zeros((rows, cols), dtype=values.dtype)
    dense[row_of, col] = values
    return dense


def _json_numbers(values: list[Any], dtype: np.dtype[Any], where: str) -> np.ndarray:
    try:
        parsed = np.asarray(values)
    except ValueError as exc:
        raise InvalidRequest(f"{where} must be a rectangular list of numbers ({exc}).") from exc
    if parsed.dtype.kind not in "iuf":
        raise InvalidRequest(f"{where} must hold only numbers (within int64 range for integers).")
    if dtype.kind == "f":
        return parsed.astype(np.float32)
    if parsed.dtype.kind == "u" and parsed.size and parsed.max() > np.iinfo(np.int64).max:
        raise InvalidRequest(f"{where} holds an integer beyond the int64 range.")
    if parsed.dtype.kind == "f" and not np.all((parsed == np.round(parsed)) & (np.abs(parsed) < 2.0**63)):
        raise InvalidRequest(f"{where} is int64 but holds a value that is not a whole number in range.")
    return parsed.astype(np.int64)


def _json_int_list(value: Any, where: str, key: str) -> list[int]:
    if not isinstance(value, list) or not all(is_integer(v) and -(2**63) <= v < 2**63 for v in value):
        raise InvalidRequest(f"{where}.{key} must be a list of int64 integers.")
    return value


def _checked_values(array: np.ndarray, where: str) -> np.ndarray:
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise InvalidRequest(f"{where} holds NaN or infinite values.")
    return np.ascontiguousarray(array)
