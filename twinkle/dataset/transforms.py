"""The functions Dataset.map and Dataset.encode run over Arrow batches, in this process or in worker processes.

They are module-level so they pickle, and take everything they use as arguments so the datasets library
can fingerprint them: an identical map over identical rows is then read back from its cache. The
fingerprint sees objects, not the code behind them, so each call also passes `twinkle_version`: results
cached by another Twinkle release are not reused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twinkle.data_format import Trajectory, as_trajectory
from twinkle.dataset.rows import RowKind, decode_row, store_rows, unstack
from twinkle.errors import InvalidRequest
from twinkle.preprocessor.base import Preprocessor
from twinkle.template.base import Template

MapFunction = Callable[[Any], Any]
PROBE_ROWS = 64


def map_batch(
    batch: Mapping[str, list[Any]],
    *,
    function: MapFunction,
    batched: bool,
    input_kind: RowKind,
    output_kind: RowKind,
    columns: Sequence[str],
    twinkle_version: str,
) -> dict[str, list[Any]]:
    rows = [decode_row(row, input_kind) for row in unstack(batch)]
    outputs = flatten_outputs(call(function, rows, batched))
    for output in outputs:
        if output_kind_of(output) != output_kind:
            raise InvalidRequest(
                f"A map function returned both {output_kind} rows and {output_kind_of(output)} rows.",
                hint="Return Trajectories for every row, or dicts for every row.",
            )
    return store_rows(outputs, output_kind, columns)


def encode_batch(
    batch: Mapping[str, list[Any]],
    *,
    template: Template,
    input_kind: RowKind,
    add_generation_prompt: bool,
    twinkle_version: str,
) -> dict[str, list[Any]]:
    trajectories = [as_trajectory(decode_row(row, input_kind)) for row in unstack(batch)]  # type: ignore[arg-type]
    return store_rows(template.batch_encode(trajectories, add_generation_prompt), "feature")


def call(function: MapFunction, rows: list[Any], batched: bool) -> list[Any]:
    """The function's outputs, one per row (batched functions take and return whole lists)."""
    if not batched:
        return [function(row) for row in rows]
    if isinstance(function, Preprocessor):
        return function.batch(rows)
    outputs = function(rows)
    if not isinstance(outputs, list):
        raise InvalidRequest(
            f"A batched map function returned a {type(outputs).__name__}.",
            hint="With batched=True the function takes a list of rows and returns a list of outputs.",
        )
    return outputs


def flatten_outputs(outputs: list[Any]) -> list[Any]:
    """Outputs with lists spread out (a row may yield several) and None (a dropped row) left out."""
    flat: list[Any] = []
    for output in outputs:
        for item in output if isinstance(output, list) else [output]:
            if item is not None:
                output_kind_of(item)
                flat.append(item)
    return flat


def output_kind_of(item: Any) -> RowKind:
    if isinstance(item, Trajectory):
        return "trajectory"
    if isinstance(item, Mapping):
        return "raw"
    raise InvalidRequest(
        f"A map function returned a {type(item).__name__}.",
        hint="Return a Trajectory, a dict of columns, a list of them, or None to drop the row.",
    )


def probe_output(
    function: MapFunction, rows: Sequence[Mapping[str, Any]], input_kind: RowKind, batched: bool
) -> tuple[RowKind, list[str]]:
    """What the function returns, learnt from the first rows that give anything: its kind and columns."""
    for start in range(min(len(rows), PROBE_ROWS)):
        chunk = [decode_row(row, input_kind) for row in rows[start : start + (PROBE_ROWS if batched else 1)]]
        outputs = flatten_outputs(call(function, chunk, batched))
        if outputs:
            kind = output_kind_of(outputs[0])
            return kind, list(outputs[0]) if kind == "raw" else []
        if batched:
            break
    return ("trajectory" if input_kind == "raw" else input_kind), []
