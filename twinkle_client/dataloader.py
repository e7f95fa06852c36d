"""DataLoader: the local twinkle DataLoader. It reads local and remote-encoded Datasets alike, because
a remote Dataset holds its encoded rows on this machine once encode() returns."""

from twinkle.dataloader import DataLoader

__all__ = ["DataLoader"]
