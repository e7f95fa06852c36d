"""The S3-compatible export store against moto's S3 served over real HTTP: uploads (multipart when large), reuse,
versions, deletion, and the errors a missing bucket or bad keys give."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import pytest

from tests.harness import free_port
from twinkle.checkpoints import MERGED_RECORD, METADATA_FILE, CheckpointRef
from twinkle.config.models import ExportStoreConfig
from twinkle.errors import ExportStoreFailure, NotFound
from twinkle.export_store import PART_BYTES, ExportStore
from twinkle.tar_stream import TarStream

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REF = CheckpointRef("s1:train:0", "weights", "step-1")
EXCLUDE = frozenset({METADATA_FILE})


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    name = f"unit-{request.node.name.replace('_', '-')[-40:].strip('-')}".lower()
    client(s3_endpoint).create_bucket(Bucket=name)
    return name


def client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def store(endpoint: str, bucket: str, *, ttl: int = 600, env: dict[str, str] = ENV, **kw: Any) -> ExportStore:
    return ExportStore(ExportStoreConfig(bucket=bucket, endpoint_url=endpoint, key_prefix="exp/", **kw), ttl, env=env)


def checkpoint(root: Path, *, big: bool = False, stamp: float = 1.0) -> Path:
    directory = root / "ckpt"
    directory.mkdir(exist_ok=True)
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(os.urandom(PART_BYTES + 1000 if big else 3000))
    (directory / METADATA_FILE).write_text(json.dumps({"time": stamp}))
    return directory


def keys(endpoint: str, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in client(endpoint).list_objects_v2(Bucket=bucket).get("Contents", []))


def test_the_archive_is_uploaded_once_and_its_presigned_url_serves_the_api_s_tar(
        s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    directory = checkpoint(tmp_path, big=True)  # over one part: a streamed multipart upload
    exports = store(s3_endpoint, bucket, ttl=900)
    url, expires = exports.archive_url("tA", REF, directory, exclude=EXCLUDE)
    assert unquote(url).startswith(f"{s3_endpoint}/{bucket}/exp/tA/s1:train:0/weights/step-1/")
    query = parse_qs(urlsplit(url).query)
    assert query["X-Amz-Expires"] == ["900"] and "X-Amz-Signature" in query
    data = httpx.get(url).raise_for_status().content
    assert data == b"".join(TarStream(directory, "step-1", exclude=EXCLUDE).chunks())
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == ["step-1/adapter_config.json", "step-1/adapter_model.safetensors"]

    [key] = keys(s3_endpoint, bucket)
    client(s3_endpoint).put_object(Bucket=bucket, Key=key, Body=b"marker")  # a second call must not upload again
    again, later = exports.archive_url("tA", REF, directory, exclude=EXCLUDE)
    assert httpx.get(again).content == b"marker" and later >= expires


def test_an_overwritten_checkpoint_gets_a_new_object_and_the_old_one_goes(
        s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    exports = store(s3_endpoint, bucket)
    directory = checkpoint(tmp_path, stamp=1.0)
    exports.archive_url("tA", REF, directory)
    first = keys(s3_endpoint, bucket)
    directory = checkpoint(tmp_path, stamp=2.0)  # the metadata every save rewrites
    url, _ = exports.archive_url("tA", REF, directory, exclude=EXCLUDE)
    assert len(keys(s3_endpoint, bucket)) == 1 and keys(s3_endpoint, bucket) != first
    assert httpx.get(url).content == b"".join(TarStream(directory, "step-1", exclude=EXCLUDE).chunks())


def test_files_get_urls_of_their_own_and_delete_removes_every_object_of_the_checkpoint_only(
        s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    exports = store(s3_endpoint, bucket)
    directory = checkpoint(tmp_path)
    url, _ = exports.file_url("tA", REF, directory, "adapter_model.safetensors")
    assert httpx.get(url).content == (directory / "adapter_model.safetensors").read_bytes()
    assert 'filename="adapter_model.safetensors"' in httpx.get(url).headers["Content-Disposition"]
    exports.archive_url("tA", REF, directory)
    exports.archive_url("tB", REF, directory)  # the same run id and name under another tenant
    with pytest.raises(NotFound):
        exports.file_url("tA", REF, directory, "../ckpt/adapter_config.json/x")
    (directory / "link").symlink_to(directory / "adapter_config.json")
    with pytest.raises(NotFound):
        exports.file_url("tA", REF, directory, "link")

    exports.delete("tA", REF)
    assert [k.split("/")[1] for k in keys(s3_endpoint, bucket)] == ["tB"]
    exports.delete("tA", REF)  # nothing left: no error


def test_a_merged_export_gets_objects_of_its_own_which_its_summary_in_the_checkpoint_leaves_valid(
        s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    exports = store(s3_endpoint, bucket)
    directory = checkpoint(tmp_path)
    (directory / METADATA_FILE).write_text(json.dumps({"time": 1.0}, indent=2, sort_keys=True))  # as a save writes it
    adapter_url, _ = exports.file_url("tA", REF, directory, "adapter_model.safetensors")
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text('{"model_type": "qwen3"}')
    (merged / "model.safetensors").write_bytes(os.urandom(2000))
    (merged / MERGED_RECORD).write_text('{"status": "verified"}')
    url, _ = exports.merged_file_url("tA", REF, merged, "config.json")
    assert unquote(url).startswith(f"{s3_endpoint}/{bucket}/exp/tA/s1:train:0/merged/weights/step-1/")
    assert httpx.get(url).content == (merged / "config.json").read_bytes()
    archive, _ = exports.merged_archive_url("tA", REF, merged, exclude=frozenset({MERGED_RECORD}))
    with tarfile.open(fileobj=io.BytesIO(httpx.get(archive).content)) as tar:
        assert sorted(tar.getnames()) == ["step-1-merged/config.json", "step-1-merged/model.safetensors"]

    before = keys(s3_endpoint, bucket)
    export = {"status": "verified", "max_abs_diff": 1e-6}  # what export_merged adds to the checkpoint's metadata
    (directory / METADATA_FILE).write_text(json.dumps({"export": export, "time": 1.0}, indent=2, sort_keys=True))
    assert exports.file_url("tA", REF, directory, "adapter_model.safetensors")[0].split("?")[0] == \
        adapter_url.split("?")[0]
    assert keys(s3_endpoint, bucket) == before and httpx.get(adapter_url).status_code == 200  # nothing re-uploaded

    exports.delete("tA", REF)
    assert keys(s3_endpoint, bucket) == []


def test_a_missing_bucket_and_bad_credentials_are_clear_server_errors(s3_endpoint: str, tmp_path: Path) -> None:
    missing = store(s3_endpoint, "no-such-bucket")
    with pytest.raises(ExportStoreFailure, match="does not exist") as info:
        missing.check()
    assert info.value.status_code == 502 and "storage.export_store.bucket" in str(info.value)
    with pytest.raises(ExportStoreFailure, match=r"'no-such-bucket'.*does not exist"):
        missing.archive_url("tA", REF, checkpoint(tmp_path))

    with pytest.raises(ExportStoreFailure, match="Only one of"):
        store(s3_endpoint, "x-bucket", env={"AWS_ACCESS_KEY_ID": "testing"})
    unreachable = store(f"http://127.0.0.1:{free_port()}", "x-bucket")
    with pytest.raises(ExportStoreFailure, match="cannot be reached"):
        unreachable.check()


def test_the_store_is_off_without_config_and_the_config_refuses_bad_values() -> None:
    assert ExportStore.from_storage(SimpleNamespace(export_store=None)) is None
    for bad in ({"bucket": "No_Such"}, {"bucket": "ok-bucket", "endpoint_url": "minio:9000"},
                {"bucket": "ok-bucket", "key_prefix": "/abs"},
                {"bucket": "ok-bucket", "secret_access_key_env": "wJalrXUtnFEMI/K7MDENG"}):
        with pytest.raises(ValueError):
            ExportStoreConfig(**bad)
