"""DatasetMeta: which dataset to load, and which part of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twinkle.errors import InvalidRequest

DataSlice = range | slice | Sequence[int]


@dataclass(frozen=True)
class DatasetMeta:
    """A dataset reference and the rows to keep.

    `dataset_id` is `ms://org/name` (ModelScope), `hf://org/name` (Hugging Face), or a local json, jsonl,
    csv or parquet file or a directory of them. `subset_name` picks a hub subset (for a local directory: a
    subdirectory). `data_slice` keeps those row indices, e.g. `range(500)`; indices past the end are
    skipped, so `range(500)` keeps every row of a shorter dataset.
    """

    dataset_id: str
    subset_name: str | None = None
    split: str = "train"
    data_slice: DataSlice | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset_id, str) or not self.dataset_id.strip():
            raise InvalidRequest(
                "DatasetMeta needs a dataset_id.", hint="Use ms://org/name, hf://org/name or a path."
            )
        if self.data_slice is not None and not _is_slice(self.data_slice):
            raise InvalidRequest(
                f"data_slice must be a range, a slice or a list of row indices, got {self.data_slice!r}.",
                hint="For example data_slice=range(500).",
            )


def _is_slice(data_slice: object) -> bool:
    if isinstance(data_slice, range | slice):
        return True
    if isinstance(data_slice, str | bytes) or not isinstance(data_slice, Sequence):
        return False
    return all(isinstance(index, int) for index in data_slice)


def slice_indices(data_slice: DataSlice, length: int) -> Sequence[int]:
    """The row indices `data_slice` selects from `length` rows, skipping those past the end."""
    if isinstance(data_slice, slice):
        return range(*data_slice.indices(length))
    if isinstance(data_slice, range) and data_slice.step > 0 and data_slice.start >= 0:
        return range(data_slice.start, min(data_slice.stop, length), data_slice.step)
    return [index % length for index in data_slice if -length <= index < length]
