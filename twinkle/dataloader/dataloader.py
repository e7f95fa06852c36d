"""DataLoader: batches of a dataset's rows, epoch after epoch, resumable at any sample.

The loader's position is one number, the samples consumed so far over all epochs. Epoch `e` is the
dataset in order, or shuffled with seed `seed + e`, so the same position always means the same next
sample; `resume_from_checkpoint(n)` restores it exactly. Each `iter()` runs from the position to the end
of its epoch, so a loop that stopped early continues where it stopped, and the next loop starts the next
epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from twinkle.errors import InvalidRequest


class RowSource(Protocol):
    """What a DataLoader reads: a sized, indexable collection (a Dataset, a list of features)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class DataLoader:
    """Batches (lists of rows, e.g. InputFeatures) of `batch_size` rows; `drop_last` drops a short last batch."""

    def __init__(
        self,
        dataset: RowSource,
        batch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise InvalidRequest(f"batch_size must be at least 1, got {batch_size}.")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.consumed_train_samples = 0

    def __len__(self) -> int:
        """Batches in one whole epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def samples_per_epoch(self) -> int:
        size = len(self.dataset)
        return size - size % self.batch_size if self.drop_last else size

    @property
    def epoch(self) -> int:
        per_epoch = self.samples_per_epoch
        return self.consumed_train_samples // per_epoch if per_epoch else 0

    def __iter__(self) -> Iterator[list[Any]]:
        per_epoch = self.samples_per_epoch
        if per_epoch == 0:
            return
        epoch, offset = divmod(self.consumed_train_samples, per_epoch)
        order = self.epoch_order(epoch)[:per_epoch]
        epoch_end = (epoch + 1) * per_epoch
        while offset < per_epoch:
            indices = order[offset : offset + self.batch_size]
            if self.drop_last and len(indices) < self.batch_size:
                break  # only after resuming mid-batch: the epoch's tail no longer fills a batch
            batch = self._fetch(indices)
            offset += len(indices)
            self.consumed_train_samples = epoch * per_epoch + offset
            yield batch
        self.consumed_train_samples = epoch_end

    def epoch_order(self, epoch: int) -> list[int]:
        """The row indices of `epoch`, in the order they are served."""
        size = len(self.dataset)
        if not self.shuffle:
            return list(range(size))
        return [int(index) for index in np.random.default_rng(self.seed + epoch).permutation(size)]

    def get_state(self) -> dict[str, int]:
        """The position to save with a checkpoint; `consumed_train_samples` counts all epochs."""
        per_epoch = self.samples_per_epoch
        return {
            "consumed_train_samples": self.consumed_train_samples,
            "epoch": self.epoch,
            "samples_into_epoch": self.consumed_train_samples % per_epoch if per_epoch else 0,
            "seed": self.seed,
        }

    def resume_from_checkpoint(self, consumed_train_samples: int) -> None:
        """Skip exactly `consumed_train_samples` samples (over all epochs), as saved from get_state()."""
        if consumed_train_samples < 0:
            raise InvalidRequest(f"consumed_train_samples must be >= 0, got {consumed_train_samples}.")
        self.consumed_train_samples = int(consumed_train_samples)

    def _fetch(self, indices: Sequence[int]) -> list[Any]:
        many = getattr(self.dataset, "__getitems__", None)
        if callable(many):
            return list(many(list(indices)))
        return [self.dataset[index] for index in indices]
