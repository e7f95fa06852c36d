"""A fwd/bwd result as the `tinker_public.ForwardBackwardOutput` protobuf the SDK requires.

Per-datum values of a field are concatenated into one `BatchedTensor` with int64 byte offsets. A field
whose datums differ in trailing shape or dtype cannot share a tensor, so consecutive datums that agree
go into one `ArrayRecord` each; the SDK concatenates the records in order.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from api.tinker_codec import wire_schema as pb
from twinkle.types import ForwardBackwardOutput

_WIRE_DTYPES: dict[str, tuple[int, np.dtype[Any]]] = {
    "f": (pb.DTYPE_FLOAT32, np.dtype("<f4")),
    "i": (pb.DTYPE_INT64, np.dtype("<i8")),
    "u": (pb.DTYPE_INT64, np.dtype("<i8")),
    "b": (pb.DTYPE_INT64, np.dtype("<i8")),
}

_Signature = tuple[tuple[str, int, tuple[int, ...]], ...]


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """Serialize `out`; a ValueError here is a server bug (the SDK would crash on the result)."""
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = out.loss_fn_output_type
    for key, value in out.metrics.items():
        if key.count(":") != 1:
            raise ValueError(f"Metric key {key!r} must read 'name:reduction' with exactly one colon.")
        msg.metrics[key] = float(value)
    datums = [_wire_arrays(i, outputs) for i, outputs in enumerate(out.loss_fn_outputs)]
    if datums and any(d.keys() != datums[0].keys() for d in datums):
        raise ValueError("Every datum's loss_fn_outputs must have the same fields.")
    for _, group in itertools.groupby(datums, key=_signature):
        run = list(group)
        record = msg.loss_fn_outputs.add()
        record.type_tag = out.loss_fn_output_type
        record.num_datums = len(run)
        for name in run[0]:
            arrays = [datum[name] for datum in run]
            batched = record.fields[name]
            batched.dtype = _WIRE_DTYPES[arrays[0].dtype.kind][0]
            batched.trailing_shape.extend(arrays[0].shape[1:])
            batched.data = b"".join(a.tobytes() for a in arrays)
            ends = np.cumsum([a.nbytes for a in arrays], dtype=np.int64)
            batched.offsets = np.concatenate([np.zeros(1, np.int64), ends]).astype("<i8").tobytes()
    return bytes(msg.SerializeToString())


def _wire_arrays(index: int, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        array = np.asarray(value)
        wire = _WIRE_DTYPES.get(array.dtype.kind)
        if wire is None:
            raise ValueError(f"loss_fn_outputs[{index}][{name!r}] has dtype {array.dtype}; use float or int.")
        # The SDK rebuilds shape as [n / prod(trailing), *trailing]: a scalar travels as one element.
        arrays[name] = np.ascontiguousarray(np.atleast_1d(array), dtype=wire[1])
    return arrays


def _signature(arrays: dict[str, np.ndarray]) -> _Signature:
    return tuple((name, a.dtype.num, a.shape[1:]) for name, a in sorted(arrays.items()))
