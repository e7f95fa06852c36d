"""How a Dataset stores its rows, and their public JSON form (to_rows / from_rows).

A dataset holds one kind of row at a time:

    raw          the columns as loaded (or as a mapping function returned them)
    trajectory   after a preprocessor: messages, format, extra
    feature      after encode: input_ids, labels, attention_mask, images, vision arrays, extra

Trajectories and features are stored under a fixed Arrow schema: `extra` (free-form) as a JSON string,
vision arrays as base64 `.npy`. The public form is what `Trajectory.model_dump(mode="json")` and
`input_feature_to_row` give, so rows can be sent over HTTP and rebuilt on the other side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import datasets

from twinkle.data_format import (
    TOKEN_KEYS,
    InputFeature,
    Trajectory,
    as_trajectory,
    input_feature_from_row,
    input_feature_to_row,
)
from twinkle.errors import InvalidRequest

RowKind = Literal["raw", "trajectory", "feature"]
Decoded = dict[str, Any] | Trajectory | InputFeature

TRAJECTORY_FEATURES = datasets.Features(
    {
        "messages": datasets.List(
            {
                "role": datasets.Value("string"),
                "content": datasets.Value("string"),
                "images": datasets.List(datasets.Value("string")),
            }
        ),
        "format": datasets.Value("string"),
        "extra": datasets.Value("string"),
    }
)
FEATURE_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int64")),
        "labels": datasets.List(datasets.Value("int64")),
        "attention_mask": datasets.List(datasets.Value("int64")),
        "images": datasets.List(datasets.Value("string")),
        "vision": datasets.Value("string"),
        "extra": datasets.Value("string"),
    }
)
STORED_FEATURES: dict[RowKind, datasets.Features | None] = {
    "raw": None,
    "trajectory": TRAJECTORY_FEATURES,
    "feature": FEATURE_FEATURES,
}


def store_trajectory(trajectory: Trajectory) -> dict[str, Any]:
    row = trajectory.model_dump(mode="json")
    row["extra"] = json.dumps(row["extra"], ensure_ascii=False)
    return row


def load_trajectory(row: Mapping[str, Any]) -> Trajectory:
    return Trajectory.model_validate({**row, "extra": json.loads(row["extra"])})


def store_feature(feature: InputFeature) -> dict[str, Any]:
    public = input_feature_to_row(feature)
    known = {*TOKEN_KEYS, "images", "extra"}
    vision = {key: value for key, value in public.items() if key not in known}
    return {
        **{key: public[key] for key in TOKEN_KEYS},
        "images": public.get("images"),
        "vision": json.dumps(vision) if vision else None,
        "extra": json.dumps(public.get("extra", {}), ensure_ascii=False),
    }


def load_feature(row: Mapping[str, Any]) -> InputFeature:
    public: dict[str, Any] = {key: row[key] for key in TOKEN_KEYS}
    if row.get("images") is not None:
        public["images"] = row["images"]
    if row.get("vision"):
        public.update(json.loads(row["vision"]))
    public["extra"] = json.loads(row["extra"]) if row.get("extra") else {}
    return input_feature_from_row(public)


def decode_row(row: Mapping[str, Any], kind: RowKind) -> Decoded:
    """A stored row as users see it: a dict, a Trajectory or an InputFeature."""
    if kind == "trajectory":
        return load_trajectory(row)
    if kind == "feature":
        return load_feature(row)
    return dict(row)


def store_rows(rows: Sequence[Any], kind: RowKind, columns: Sequence[str] = ()) -> dict[str, list[Any]]:
    """Decoded rows of one kind as the column dict Arrow stores; raw rows keep `columns`."""
    if kind == "trajectory":
        stored = [store_trajectory(row) for row in rows]
        columns = list(TRAJECTORY_FEATURES)
    elif kind == "feature":
        stored = [store_feature(row) for row in rows]
        columns = list(FEATURE_FEATURES)
    else:
        stored = [dict(row) for row in rows]
        for row in stored:
            unexpected = set(row) - set(columns)
            if unexpected:
                raise InvalidRequest(
                    f"A mapped row has columns {sorted(unexpected)} that the first row did not have.",
                    hint=f"Return the same columns for every row: {sorted(columns)}.",
                )
    return {name: [row.get(name) for row in stored] for name in columns}


def unstack(batch: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    """Arrow's column dict as a list of row dicts."""
    names = list(batch)
    length = len(batch[names[0]]) if names else 0
    return [{name: batch[name][index] for name in names} for index in range(length)]


def public_row(decoded: Decoded, kind: RowKind) -> dict[str, Any]:
    """The JSON-friendly form of one decoded row."""
    if kind == "trajectory":
        return cast(Trajectory, decoded).model_dump(mode="json")
    if kind == "feature":
        return input_feature_to_row(cast(InputFeature, decoded))
    return dict(cast(Mapping[str, Any], decoded))


def from_public_row(row: Mapping[str, Any] | Trajectory, kind: RowKind) -> Decoded:
    if kind == "trajectory":
        return as_trajectory(row)
    if kind == "feature":
        return input_feature_from_row(cast(Mapping[str, Any], row))
    return dict(cast(Mapping[str, Any], row))


def infer_kind(row: Mapping[str, Any] | Trajectory) -> RowKind:
    """What a public row is: an encoded feature, a trajectory, or raw columns."""
    if isinstance(row, Trajectory):
        return "trajectory"
    if all(key in row for key in TOKEN_KEYS):
        return "feature"
    if "messages" in row and set(row) <= {"messages", "extra", "format"}:
        return "trajectory"
    return "raw"
