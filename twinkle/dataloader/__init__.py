"""Batches over a dataset, resumable from the number of samples a checkpoint says were consumed."""

from twinkle.dataloader.dataloader import DataLoader, RowSource

__all__ = ["DataLoader", "RowSource"]
