"""Loading a DatasetMeta's rows: local json, jsonl, csv and parquet files, or a hub through the same path.

Local rows may name images by paths relative to the data (the shipped LaTeX-OCR sample does); the loader
makes such paths absolute, relative to the data file's folder (for a directory: that directory), so the
rows stay valid wherever the program runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from twinkle.dataset.meta import DatasetMeta, slice_indices
from twinkle.errors import InvalidRequest
from twinkle.template.hub import HubId, fetch_from_hub, parse_hub_id

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")
IMAGE_COLUMNS = ("image", "images")


def load_rows(meta: DatasetMeta) -> datasets.Dataset:
    """The rows `meta` names, sliced by `meta.data_slice`."""
    hub_id = parse_hub_id(meta.dataset_id)
    if hub_id is None:
        table = _load_local(meta)
    else:
        table = fetch_from_hub(hub_id, "dataset", lambda: _load_from_hub(hub_id, meta))
    if meta.data_slice is not None:
        table = table.select(slice_indices(meta.data_slice, len(table)))
    return table


def _load_from_hub(hub_id: HubId, meta: DatasetMeta) -> datasets.Dataset:
    loaders: dict[str, Callable[[], Any]] = {
        "hf": lambda: datasets.load_dataset(hub_id.repo_id, name=meta.subset_name, split=meta.split),
        "ms": lambda: _modelscope_dataset(hub_id.repo_id, meta),
    }
    table = loaders[hub_id.hub]()
    if not isinstance(table, datasets.Dataset):
        raise InvalidRequest(
            f"{hub_id} split {meta.split!r} did not load as one table.", hint="Name a split."
        )
    return table


def _modelscope_dataset(repo_id: str, meta: DatasetMeta) -> Any:
    from modelscope.msdatasets import MsDataset  # type: ignore[import-not-found]

    loaded = MsDataset.load(repo_id, subset_name=meta.subset_name or "default", split=meta.split)
    return loaded.to_hf_dataset() if hasattr(loaded, "to_hf_dataset") else loaded


def _load_local(meta: DatasetMeta) -> datasets.Dataset:
    path = Path(meta.dataset_id).expanduser()
    if not path.exists():
        raise InvalidRequest(
            f"Dataset {meta.dataset_id!r} is not a local file or directory.",
            hint="Pass a json, jsonl, csv or parquet file, a directory of them, ms://org/name or hf://org/name.",
        )
    if path.is_file():
        if meta.subset_name is not None:
            raise InvalidRequest(f"A single file has no subsets, but subset_name={meta.subset_name!r}.")
        files, base = [path], path.parent
    else:
        base = path / meta.subset_name if meta.subset_name else path
        files = _split_files(_data_files(base), meta.split, base)
    builders = {BUILDERS.get(file.suffix.lower()) for file in files}
    if None in builders or len(builders) != 1:
        raise InvalidRequest(
            f"Cannot load {', '.join(sorted({f.suffix or f.name for f in files}))} files together.",
            hint=f"Use files of one format: {', '.join(sorted(BUILDERS))}.",
        )
    try:
        table = datasets.load_dataset(builders.pop(), data_files=[str(file) for file in files], split="train")
    except (ValueError, datasets.exceptions.DatasetGenerationError) as error:
        raise InvalidRequest(
            f"Cannot read {meta.dataset_id}: {error}", hint="Check the file's format."
        ) from None
    return _absolute_image_paths(table, base)


def _data_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise InvalidRequest(f"{directory} is not a directory.", hint="subset_name names a subdirectory.")
    files = sorted(
        file
        for file in directory.rglob("*")
        if file.is_file()
        and file.suffix.lower() in BUILDERS
        and not any(part.startswith(".") for part in file.relative_to(directory).parts)
    )
    if not files:
        raise InvalidRequest(f"{directory} holds no {', '.join(sorted(BUILDERS))} files.")
    return files


def _split_files(files: list[Path], split: str, directory: Path) -> list[Path]:
    """Files named after a split (train.jsonl, test-0001.parquet) form that split; unnamed files are `train`."""
    by_split: dict[str, list[Path]] = {}
    for file in files:
        words = re.split(r"[^a-z0-9]+", file.stem.lower())
        name = next((word for word in words if word in SPLIT_NAMES), None)
        by_split.setdefault(name or "train", []).append(file)
    if split not in by_split:
        raise InvalidRequest(
            f"{directory} has no files for split {split!r}.",
            hint=f"Its splits: {', '.join(sorted(by_split))}.",
        )
    return by_split[split]


def _absolute_image_paths(table: datasets.Dataset, base: Path) -> datasets.Dataset:
    for name in IMAGE_COLUMNS:
        feature = table.features.get(name)
        holds_paths = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
        holds_path_lists = isinstance(feature, datasets.List) and isinstance(feature.feature, datasets.Value)
        if holds_paths or holds_path_lists:
            table = table.map(
                _resolve_paths, fn_kwargs={"column": name, "base": str(base)}, desc="Image paths"
            )
    return table


def _resolve_paths(row: dict[str, Any], column: str, base: str) -> dict[str, Any]:
    value = row[column]
    if isinstance(value, list):
        return {column: [_resolve(item, base) for item in value]}
    return {column: _resolve(value, base)}


def _resolve(value: Any, base: str) -> Any:
    if not isinstance(value, str) or not value or value.startswith("data:") or "://" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return value
    candidate = Path(base) / path
    return str(candidate.resolve()) if candidate.exists() else value
