"""TwinkleClient.import_adapter: what it uploads (the adapter's two files only, or an archive as it is) and what
it returns; the server's own checks are tested end to end (tests/e2e/test_adapter_import.py)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.client.fake_server import FakeTwinkleServer
from twinkle_client import BadRequestError, InvalidArgument, TwinkleClient

REPLY = {"training_run_id": "import-1", "path": "tinker://import-1/weights/mine",
         "sampler_path": "tinker://import-1/sampler_weights/mine", "base_model": "Qwen/Qwen3.5-4B", "lora_rank": 8,
         "lora_config": {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
         "size_bytes": 1234, "ignored_files": []}


class Uploads:
    """The fake server, plus /import_adapter answering REPLY (or `refusal`) and keeping what was uploaded."""

    def __init__(self, server: FakeTwinkleServer) -> None:
        self.server = server
        self.received: list[httpx.Request] = []
        self.refusal: str | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/api/v1/import_adapter":
            return self.server.handle(request)
        request.read()
        self.received.append(request)
        if self.refusal:
            return httpx.Response(400, json={"error": self.refusal, "category": "user", "code": "invalid_request"})
        return httpx.Response(200, json=REPLY)

    def members(self, index: int = -1) -> dict[str, bytes]:
        with tarfile.open(fileobj=io.BytesIO(self.received[index].content)) as tar:
            return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]


@pytest.fixture
def uploads(server: FakeTwinkleServer) -> Iterator[tuple[TwinkleClient, Uploads]]:
    fake = Uploads(server)
    with TwinkleClient("http://twinkle.test:8000", server.api_key, transport=httpx.MockTransport(fake.handle)) as c:
        yield c, fake


def adapter_dir(tmp_path: Path, **extra: bytes) -> Path:
    directory = tmp_path / "adapter"
    directory.mkdir()
    files: dict[str, Any] = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"weights", **extra}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def test_a_directory_is_sent_as_a_tar_of_its_two_adapter_files_only(uploads: tuple[TwinkleClient, Uploads],
                                                                    tmp_path: Path) -> None:
    client, fake = uploads
    directory = adapter_dir(tmp_path, **{"README.md": b"# hi", "optimizer.pt": b"pickle", "training_args.bin": b"p"})
    imported = client.import_adapter(directory, base_model="Qwen/Qwen3.5-4B", name="mine", ttl_seconds=60)
    assert fake.members() == {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"weights"}
    request = fake.received[-1]
    assert dict(request.url.params) == {"base_model": "Qwen/Qwen3.5-4B", "name": "mine", "ttl_seconds": "60"}
    assert request.headers["content-type"] == "application/x-tar"
    assert int(request.headers["content-length"]) == len(request.content)
    assert imported.twinkle_path == "twinkle://import-1/weights/mine"
    assert imported.twinkle_sampler_path == "twinkle://import-1/sampler_weights/mine"
    assert imported.lora_config["target_modules"] == ["q_proj", "v_proj"]


def test_an_archive_is_sent_as_it_is(uploads: tuple[TwinkleClient, Uploads], tmp_path: Path) -> None:
    client, fake = uploads
    archive = tmp_path / "adapter.tar.gz"
    archive.write_bytes(b"\x1f\x8b any gzip bytes")
    client.import_adapter(archive)
    assert fake.received[-1].content == b"\x1f\x8b any gzip bytes" and not fake.received[-1].url.params


def test_a_path_that_is_neither_is_refused_before_sending(uploads: tuple[TwinkleClient, Uploads],
                                                         tmp_path: Path) -> None:
    client, fake = uploads
    with pytest.raises(InvalidArgument, match="neither an adapter directory nor an archive"):
        client.import_adapter(tmp_path / "missing")
    assert fake.received == []


def test_the_servers_refusal_is_raised_with_its_message(uploads: tuple[TwinkleClient, Uploads],
                                                       tmp_path: Path) -> None:
    client, fake = uploads
    fake.refusal = "The adapter was trained on 'other/model', which this server does not serve."
    with pytest.raises(BadRequestError, match="trained on 'other/model'"):
        client.import_adapter(adapter_dir(tmp_path))
