"""Dataset: load rows, turn them into trajectories with preprocessors, and encode them with a template.

    dataset = Dataset(dataset_meta=DatasetMeta('cookbook/data/self_cognition.jsonl', data_slice=range(50)))
    dataset.set_template('Qwen3_5Template', model_id=model_dir, max_length=512)
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'twinkle模型', 'model_author': 'ModelScope'})
    dataset.encode(batched=True)
    dataset[0]  # an InputFeature

`map` and `encode` change the dataset in place (and return it, for chaining). Rows live in an Arrow table
of the datasets library, which runs `num_proc` worker processes and caches results for
`load_from_cache_file=True`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import datasets

from twinkle import __version__
from twinkle.data_format import Trajectory
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.rows import (
    STORED_FEATURES,
    Decoded,
    RowKind,
    decode_row,
    from_public_row,
    infer_kind,
    public_row,
    store_rows,
    unstack,
)
from twinkle.dataset.sources import load_rows
from twinkle.dataset.transforms import MapFunction, encode_batch, map_batch, probe_output
from twinkle.errors import InvalidRequest
from twinkle.preprocessor.base import get_preprocessor
from twinkle.template.base import Template
from twinkle.template.registry import get_template


class Dataset:
    """Rows of one kind at a time: raw columns, trajectories (after `map`) or InputFeatures (after `encode`)."""

    def __init__(self, dataset_meta: DatasetMeta | str) -> None:
        meta = DatasetMeta(dataset_meta) if isinstance(dataset_meta, str) else dataset_meta
        self.dataset_meta: DatasetMeta | None = meta
        self.template: Template | None = None
        self._table = load_rows(meta)
        self._kind: RowKind = "raw"

    @classmethod
    def from_rows(
        cls, rows: Iterable[Mapping[str, Any] | Trajectory], kind: RowKind | None = None
    ) -> Dataset:
        """A dataset of rows in their public form (see to_rows); `kind` is inferred from the first row."""
        rows = list(rows)
        kind = kind or (infer_kind(rows[0]) if rows else "raw")
        decoded = [from_public_row(row, kind) for row in rows]
        columns = [str(name) for name in rows[0]] if kind == "raw" and rows else []
        table = datasets.Dataset.from_dict(store_rows(decoded, kind, columns), features=STORED_FEATURES[kind])
        dataset = cls.__new__(cls)
        dataset.dataset_meta = None
        dataset.template = None
        dataset._table = table
        dataset._kind = kind
        return dataset

    def to_rows(self) -> list[dict[str, Any]]:
        """Every row in a JSON-friendly form: column dicts, Trajectory dumps or `input_feature_to_row` dicts."""
        return [public_row(row, self._kind) for row in self]

    @property
    def kind(self) -> RowKind:
        return self._kind

    def set_template(self, template: str | Template, **init_args: Any) -> Dataset:
        """The template `encode` uses: a Template, or a registered name built with `init_args` (model_id, ...)."""
        if isinstance(template, Template):
            if init_args:
                raise InvalidRequest(
                    "init_args only go with a template name.", hint="Configure the Template itself."
                )
            self.template = template
        else:
            self.template = get_template(template, **init_args)
        return self

    def map(
        self,
        processor: str | MapFunction | type,
        init_args: Mapping[str, Any] | None = None,
        batched: bool = False,
        load_from_cache_file: bool = True,
        num_proc: int = 1,
        batch_size: int = 1000,
    ) -> Dataset:
        """Apply a preprocessor to every row: a registered name (built with `init_args`), a Preprocessor
        class, or any callable taking one row (a list of rows when `batched`).

        The function returns a Trajectory, a dict of new columns, a list of them or None (the row is dropped).
        """
        function = self._map_function(processor, init_args)
        if self._kind == "feature":
            raise InvalidRequest(
                "This dataset is already encoded.", hint="Map preprocessors before encode()."
            )
        output_kind, columns = probe_output(function, _RowView(self._table), self._kind, batched)
        self._table = self._table.map(
            map_batch,
            batched=True,
            batch_size=batch_size,
            remove_columns=self._table.column_names,
            features=STORED_FEATURES[output_kind],
            fn_kwargs={
                "function": function,
                "batched": batched,
                "input_kind": self._kind,
                "output_kind": output_kind,
                "columns": columns,
                "twinkle_version": __version__,
            },
            load_from_cache_file=load_from_cache_file,
            num_proc=_workers(num_proc),
            desc=f"Map {getattr(function, '__name__', type(function).__name__)}",
        )
        self._kind = output_kind
        return self

    def encode(
        self,
        batched: bool = True,
        num_proc: int = 1,
        load_from_cache_file: bool = True,
        add_generation_prompt: bool = False,
    ) -> Dataset:
        """Turn every trajectory into an InputFeature with the template from set_template.

        `num_proc` > 1 encodes in that many worker processes, with the same result; `add_generation_prompt`
        ends each row with an open assistant turn, for prompts a sampler completes.
        """
        if self.template is None:
            raise InvalidRequest("encode() needs a template.", hint="Call set_template(...) first.")
        if self._kind == "feature":
            raise InvalidRequest("This dataset is already encoded.")
        if self._kind == "raw" and "messages" not in self._table.column_names:
            raise InvalidRequest(
                f"The rows are not trajectories yet (columns: {self._table.column_names}).",
                hint="Map a preprocessor that makes trajectories first, e.g. map('SelfCognitionProcessor', ...).",
            )
        self._table = self._table.map(
            encode_batch,
            batched=True,
            batch_size=1000 if batched else 1,
            remove_columns=self._table.column_names,
            features=STORED_FEATURES["feature"],
            fn_kwargs={
                "template": self.template,
                "input_kind": self._kind,
                "add_generation_prompt": add_generation_prompt,
                "twinkle_version": __version__,
            },
            load_from_cache_file=load_from_cache_file,
            num_proc=_workers(num_proc),
            desc="Encode",
        )
        self._kind = "feature"
        return self

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, index: int) -> Decoded:
        if not isinstance(index, int):
            raise InvalidRequest(f"Dataset indices are ints, got {type(index).__name__}.")
        if not -len(self) <= index < len(self):
            raise IndexError(f"Row {index} of a dataset of {len(self)} rows.")
        return decode_row(self._table[index % len(self)], self._kind)

    def __getitems__(self, indices: Sequence[int]) -> list[Decoded]:
        """Several rows in one read of the table (the DataLoader fetches whole batches this way)."""
        if not indices:
            return []
        return [decode_row(row, self._kind) for row in unstack(self._table[list(indices)])]

    def __iter__(self) -> Iterator[Decoded]:
        for row in self._table:
            yield decode_row(row, self._kind)

    def __repr__(self) -> str:
        source = self.dataset_meta.dataset_id if self.dataset_meta else "rows"
        return f"Dataset({source!r}, kind={self._kind}, rows={len(self)})"

    def _map_function(
        self, processor: str | MapFunction | type, init_args: Mapping[str, Any] | None
    ) -> MapFunction:
        if isinstance(processor, str):
            return get_preprocessor(processor, **dict(init_args or {}))
        if isinstance(processor, type):
            return processor(**dict(init_args or {}))  # type: ignore[no-any-return]
        if init_args:
            raise InvalidRequest(
                "init_args only go with a preprocessor name or class.", hint="Build the processor yourself."
            )
        if not callable(processor):
            raise InvalidRequest(
                f"Cannot map a {type(processor).__name__}.", hint="Pass a name or a callable."
            )
        return processor


class _RowView(Sequence[Mapping[str, Any]]):
    """Rows of an Arrow table, read on demand (probing needs only the first few)."""

    def __init__(self, table: datasets.Dataset) -> None:
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return unstack(self._table[index])
        return self._table[index]


def _workers(num_proc: int) -> int | None:
    if num_proc < 1:
        raise InvalidRequest(f"num_proc must be at least 1, got {num_proc}.")
    if num_proc == 1:
        return None
    # Forked workers inherit the tokenizer; its own thread pool must stay off in them to avoid deadlocks.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return num_proc
