"""Preprocessors turn dataset rows into trajectories; registered by class name for `Dataset.map('Name')`.

A preprocessor is called with one row (a dict of the dataset's columns, or a Trajectory when the dataset
already holds trajectories) and returns a Trajectory, a list of them (one row may yield several, as DPO
pairs do), or None to drop the row.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from twinkle.data_format import Trajectory
from twinkle.errors import InvalidRequest

Row = Mapping[str, Any]
ProcessorOutput = Trajectory | list[Trajectory] | None
PreprocessorClass = TypeVar("PreprocessorClass", bound=type["Preprocessor"])

_PREPROCESSORS: dict[str, type[Preprocessor]] = {}


class Preprocessor(ABC):
    """Turns one row into trajectories. Instances must pickle: datasets run them in worker processes."""

    @abstractmethod
    def __call__(self, row: Row | Trajectory) -> ProcessorOutput: ...

    def batch(self, rows: Sequence[Row | Trajectory]) -> list[ProcessorOutput]:
        """One output per row; override when a whole batch can be processed faster than row by row."""
        return [self(row) for row in rows]

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}" for key, value in vars(self).items())
        return f"{type(self).__name__}({fields})"


def register_preprocessor(cls: PreprocessorClass) -> PreprocessorClass:
    """Make a Preprocessor subclass available by its class name (usable as a decorator)."""
    _PREPROCESSORS[cls.__name__] = cls
    return cls


def preprocessor_names() -> list[str]:
    return sorted(_PREPROCESSORS)


def get_preprocessor(name: str, **init_args: Any) -> Preprocessor:
    """A new preprocessor of the class registered as `name`, built with `init_args`."""
    if name not in _PREPROCESSORS:
        raise InvalidRequest(
            f"Unknown preprocessor {name!r}.", hint=f"Valid names: {', '.join(preprocessor_names())}."
        )
    cls = _PREPROCESSORS[name]
    try:
        inspect.signature(cls).bind(**init_args)
    except TypeError as error:
        raise InvalidRequest(
            f"{name} cannot be built with {sorted(init_args)}: {error}.",
            hint=f"Its arguments are {inspect.signature(cls)}.",
        ) from None
    return cls(**init_args)


def column(row: Row | Trajectory, key: str, processor: str) -> Any:
    """`row[key]`, or an error naming the columns the row does have."""
    if isinstance(row, Trajectory):
        raise InvalidRequest(
            f"{processor} reads raw rows, but this dataset already holds trajectories.",
            hint="Map it on the dataset as loaded, before any other preprocessor.",
        )
    if key not in row:
        raise InvalidRequest(
            f"{processor} needs a {key!r} column; this row has {sorted(row)}.",
            hint="Pick the preprocessor that matches the dataset, or pass the column names it takes.",
        )
    return row[key]
