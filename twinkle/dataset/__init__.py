"""Datasets on the user's machine: load rows, preprocess them into trajectories, encode them into tokens."""

from twinkle.dataset.dataset import Dataset
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.rows import RowKind

__all__ = ["Dataset", "DatasetMeta", "RowKind"]
