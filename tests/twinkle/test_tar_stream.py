"""A checkpoint directory streamed as tar: readable by tarfile, exactly the announced length."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from twinkle.tar_stream import TarStream


def test_the_stream_is_a_tar_of_the_directory_with_the_announced_length(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 5000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("x")
    (tmp_path / "checkpoint_metadata.json").write_text("{}")
    stream = TarStream(tmp_path, "final", exclude=frozenset({"checkpoint_metadata.json"}))
    chunks = list(stream.chunks())
    data = b"".join(chunks)
    assert len(data) == stream.content_length and len(data) % tarfile.RECORDSIZE == 0
    assert max(len(c) for c in chunks) <= 1 << 20  # streamed in bounded pieces, never the whole file at once
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["final/adapter_config.json", "final/adapter_model.safetensors", "final/sub/x.txt"]
        member = tar.extractfile("final/adapter_model.safetensors")
        assert member is not None and member.read() == bytes(range(256)) * 5000


def test_files_are_sent_as_they_were_when_the_stream_was_made(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"a" * 1000)
    stream = TarStream(tmp_path, "c")
    (tmp_path / "a.bin").unlink()  # a checkpoint deleted or replaced while it downloads
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream.chunks()))) as tar:
        member = tar.extractfile("c/a.bin")
        assert member is not None and member.read() == b"a" * 1000
