"""A checkpoint directory as a POSIX tar stream: known length up front, read in chunks, never buffered whole.

`tarfile` writes into a file object and pulls whole members through it, so it cannot hand out chunks as
they are produced; the format is simple enough to emit directly: a 512-byte header per member, its
bytes padded to 512, two zero blocks, padding to tar's 10 KiB record size.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
CHUNK = 1 << 20


class TarStream:
    """The files of `directory` (recursively, sorted) under the top-level folder `prefix`.

    Files are opened when the stream is made, so the bytes sent are the ones that existed then even if
    the checkpoint is replaced or deleted meanwhile (checkpoints are replaced by rename, never in place).
    """

    def __init__(self, directory: Path, prefix: str, *, exclude: frozenset[str] = frozenset()) -> None:
        self._members: list[tuple[bytes, BinaryIO, int]] = []
        try:
            for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
                relative = path.relative_to(directory).as_posix()
                if relative in exclude:
                    continue
                handle = open(path, "rb")  # noqa: SIM115 - closed by chunks() or close()
                size = os.fstat(handle.fileno()).st_size
                info = tarfile.TarInfo(f"{prefix}/{relative}")
                info.size, info.mode, info.mtime = size, 0o644, int(path.stat().st_mtime)
                self._members.append((info.tobuf(format=tarfile.PAX_FORMAT), handle, size))
        except BaseException:
            self.close()
            raise
        body = sum(len(header) + size + (-size) % BLOCK for header, _, size in self._members) + 2 * BLOCK
        self.content_length = body + (-body) % RECORD

    def chunks(self) -> Iterator[bytes]:
        sent = 0
        try:
            for header, handle, size in self._members:
                yield header
                sent += len(header)
                left = size
                while left > 0:
                    data = handle.read(min(CHUNK, left))
                    if not data:  # the file shrank after it was opened: keep the promised length
                        data = bytes(min(CHUNK, left))
                    left -= len(data)
                    sent += len(data)
                    yield data
                pad = (-size) % BLOCK
                sent += pad
                yield bytes(pad)
            yield bytes(self.content_length - sent)  # end-of-archive blocks and record padding
        finally:
            self.close()

    def close(self) -> None:
        for _, handle, _ in self._members:
            handle.close()
