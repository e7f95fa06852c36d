"""Checkpoint downloads from an S3-compatible bucket (`storage.export_store`): upload once, hand out presigned URLs.

With the store configured, the archive route and `get_external_weights_urls` answer presigned GET URLs of
objects in the bucket instead of signed URLs of the API's own download routes; the bytes are the same (the
archive is the TarStream the API would send). An object is uploaded the first time it is asked for, streamed
in multipart parts so a checkpoint of any size never sits in memory, and found again by a HEAD afterwards.

Keys are `<key_prefix><tenant>/<run>/<kind>/<name>/<version>/<member>`: the tenant is the hash of the API key
(twinkle.auth), so one tenant's objects never share a prefix with another's; the version is a hash of the
checkpoint's metadata file, which every save rewrites, so an overwritten training checkpoint never serves the
bytes it replaced. boto3 is imported only when a store is configured; the server runs without it otherwise.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from twinkle.checkpoints import MERGED_RECORD, METADATA_FILE, CheckpointRef
from twinkle.errors import ExportStoreFailure, NotFound
from twinkle.tar_stream import TarStream

if TYPE_CHECKING:
    from twinkle.config.models import ExportStoreConfig

ARCHIVE = "archive.tar"
PART_BYTES = 16 << 20  # multipart part size; at most `_CONCURRENCY` parts are in memory at once
_CONCURRENCY = 4


class ExportStore:
    def __init__(self, config: ExportStoreConfig, ttl_seconds: int, *, env: Mapping[str, str] | None = None) -> None:
        import boto3  # deferred: only servers that configure a store need boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        env = os.environ if env is None else env
        access, secret = env.get(config.access_key_id_env), env.get(config.secret_access_key_env)
        if bool(access) != bool(secret):
            raise ExportStoreFailure(
                f"Only one of ${config.access_key_id_env} and ${config.secret_access_key_env} is set for the "
                "export store.", hint="Set both in the server's environment, or neither to use boto3's own "
                "credential chain (instance role, ~/.aws).")
        style = config.addressing_style or ("path" if config.endpoint_url else "virtual")
        self._s3 = boto3.client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region,
            aws_access_key_id=access or None, aws_secret_access_key=secret or None,
            config=Config(signature_version="s3v4", s3={"addressing_style": style}, connect_timeout=5,
                          read_timeout=60, retries={"max_attempts": 3, "mode": "standard"}))
        self._transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                        max_concurrency=_CONCURRENCY)
        self.bucket = config.bucket
        self.prefix = config.key_prefix
        self.ttl_seconds = ttl_seconds
        self._where = f"bucket {config.bucket!r}" + (f" at {config.endpoint_url}" if config.endpoint_url else "")

    @classmethod
    def from_storage(cls, storage: Any) -> ExportStore | None:
        """The store of `storage.export_store`, or None when downloads are served by the API."""
        config = getattr(storage, "export_store", None)
        if config is None:
            return None
        return cls(config, int(getattr(storage, "download_url_ttl_seconds", 3600)))

    def check(self) -> None:
        """Raise ExportStoreFailure unless the bucket answers with these credentials (a launch-time check)."""
        self._call("reach", lambda: self._s3.head_bucket(Bucket=self.bucket))

    def archive_url(self, tenant: str, ref: CheckpointRef, directory: Path, *,
                    exclude: frozenset[str] = frozenset()) -> tuple[str, int]:
        """A presigned URL of the checkpoint as one tar (uploaded now if needed), and its expiry (unix s)."""
        filename = f"{ref.run_id}-{ref.kind}-{ref.name}.tar".replace(":", "_")
        return self._presigned(self._checkpoint_prefix(tenant, ref), directory / METADATA_FILE, ref, ARCHIVE, filename,
                               lambda: _chunk_reader(TarStream(directory, ref.name, exclude=exclude).chunks()))

    def file_url(self, tenant: str, ref: CheckpointRef, directory: Path, name: str) -> tuple[str, int]:
        """A presigned URL of one file of the checkpoint (`name` relative to it), and its expiry."""
        path = _file_of(directory, name, ref)
        return self._presigned(self._checkpoint_prefix(tenant, ref), directory / METADATA_FILE, ref, f"files/{name}",
                               Path(name).name, lambda: open(path, "rb"))

    def merged_archive_url(self, tenant: str, ref: CheckpointRef, directory: Path, *,
                           exclude: frozenset[str] = frozenset()) -> tuple[str, int]:
        """The same for the checkpoint's merged export (twinkle.merged_export) in `directory`, as one tar."""
        filename = f"{ref.run_id}-{ref.kind}-{ref.name}-merged.tar".replace(":", "_")
        prefix = f"{ref.name}-merged"
        return self._presigned(self._merged_prefix(tenant, ref), directory / MERGED_RECORD, ref, ARCHIVE, filename,
                               lambda: _chunk_reader(TarStream(directory, prefix, exclude=exclude).chunks()))

    def merged_file_url(self, tenant: str, ref: CheckpointRef, directory: Path, name: str) -> tuple[str, int]:
        """A presigned URL of one file of the checkpoint's merged export."""
        path = _file_of(directory, name, ref)
        return self._presigned(self._merged_prefix(tenant, ref), directory / MERGED_RECORD, ref, f"files/{name}",
                               Path(name).name, lambda: open(path, "rb"))

    def delete(self, tenant: str, ref: CheckpointRef) -> None:
        """Remove every object of the checkpoint (all versions, archive and files) and of its merged export."""
        self._delete_under(self._checkpoint_prefix(tenant, ref))
        self._delete_under(self._merged_prefix(tenant, ref))

    def _checkpoint_prefix(self, tenant: str, ref: CheckpointRef) -> str:
        return f"{self.prefix}{tenant}/{ref.run_id}/{ref.kind}/{ref.name}/"

    def _merged_prefix(self, tenant: str, ref: CheckpointRef) -> str:
        return f"{self.prefix}{tenant}/{ref.run_id}/merged/{ref.kind}/{ref.name}/"

    def _presigned(self, prefix: str, marker: Path, ref: CheckpointRef, member: str, filename: str,
                   source: Callable[[], BinaryIO]) -> tuple[str, int]:
        """Upload `member` under `prefix`, versioned by the hash of `marker` (the metadata or record file that
        every rewrite of the directory changes), unless it is there; then sign a URL of it."""
        version = f"{prefix}{_version(marker, ref)}/"
        key = version + member
        if not self._exists(key):
            with source() as body:
                self._call("upload to", lambda: self._s3.upload_fileobj(
                    body, self.bucket, key, ExtraArgs={"ContentType": "application/octet-stream"},
                    Config=self._transfer))
            if not marker.is_file():  # deleted while uploading: leave nothing behind
                self._delete_under(prefix)
                raise NotFound(f"Checkpoint {ref.uri()} not found.")
            self._delete_under(prefix, keep=version)  # the bytes an overwrite replaced
        expires = int(time.time()) + self.ttl_seconds
        url = self._call("sign for", lambda: self._s3.generate_presigned_url(
            "get_object", ExpiresIn=self.ttl_seconds, Params={
                "Bucket": self.bucket, "Key": key,
                "ResponseContentDisposition": f'attachment; filename="{filename}"'}))
        return str(url), expires

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._s3.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._failure(exc, "read from") from None
        except Exception as exc:  # noqa: BLE001 - botocore's connection errors share no useful base
            raise self._failure(exc, "read from") from None
        return True

    def _delete_under(self, prefix: str, *, keep: str | None = None) -> None:
        def delete() -> None:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                doomed = [{"Key": o["Key"]} for o in page.get("Contents", [])
                          if keep is None or not o["Key"].startswith(keep)]
                if doomed:  # a list page holds at most 1000 keys, the most one delete_objects takes
                    self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": doomed, "Quiet": True})

        self._call("delete from", delete)

    def _call(self, doing: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ExportStoreFailure:
            raise
        except Exception as exc:
            if not _from_botocore(exc):
                raise
            raise self._failure(exc, doing) from None

    def _failure(self, exc: BaseException, doing: str) -> ExportStoreFailure:
        cause: BaseException | None = exc
        while cause is not None and not hasattr(cause, "response"):  # boto3 wraps upload errors in its own
            cause = cause.__cause__ or cause.__context__
        exc = cause or exc
        error = exc.response.get("Error", {}) if hasattr(exc, "response") else {}
        code = str(error.get("Code", ""))
        name = type(exc).__name__
        operator = "Ask the server's operator to "
        if code in ("NoSuchBucket", "404", "NotFound"):
            why, fix = "does not exist", "create it or fix storage.export_store.bucket."
        elif code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                      "InvalidToken", "ExpiredToken"):
            why, fix = f"refuses the server's credentials ({code})", (
                "check the keys in the variables named by storage.export_store.access_key_id_env and "
                "secret_access_key_env, and that they may list, read, write and delete objects in the bucket.")
        elif name == "NoCredentialsError":
            why, fix = "has no credentials to use", (
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the variables the config names) "
                "in the server's environment.")
        elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"):
            why, fix = "cannot be reached", "check storage.export_store.endpoint_url and the network to it."
        else:
            why, fix = f"failed ({code or name})", "check the store's logs and storage.export_store."
        return ExportStoreFailure(f"The checkpoint export store could not {doing} {self._where}: it {why}.",
                                  hint=operator + fix, store_error=code or name)


def _from_botocore(exc: BaseException) -> bool:
    """botocore's and s3transfer's exceptions, told apart without importing them when the store is off."""
    return type(exc).__module__.split(".")[0] in ("botocore", "boto3", "s3transfer")


def _version(marker: Path, ref: CheckpointRef) -> str:
    try:
        data = marker.read_bytes()
    except OSError:
        raise NotFound(f"Checkpoint {ref.uri()} not found.") from None
    if marker.name == METADATA_FILE:
        data = _as_saved(data)
    return hashlib.sha256(data).hexdigest()[:16]


def _as_saved(metadata_bytes: bytes) -> bytes:
    """The metadata file as its save wrote it: the merged export's summary, added to it later, changes none of
    the checkpoint's bytes, so it must not make the objects uploaded before stale (twinkle.checkpoints writes
    JSON with indent 2 and sorted keys, so removing the summary gives the saved bytes back)."""
    try:
        metadata = json.loads(metadata_bytes)
    except ValueError:
        return metadata_bytes
    if not isinstance(metadata, dict) or "export" not in metadata:
        return metadata_bytes
    metadata.pop("export")
    return json.dumps(metadata, indent=2, sort_keys=True).encode()


def _file_of(directory: Path, name: str, ref: CheckpointRef) -> Path:
    path = directory / name
    if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(directory.resolve()):
        raise NotFound(f"{name} is not a file of checkpoint {ref.uri()}.")
    return path


def _chunk_reader(chunks: Iterator[bytes]) -> BinaryIO:
    # buffered: boto3 takes whatever one read returns as a part, and every part but the last needs 5 MiB
    return io.BufferedReader(_Chunks(chunks), buffer_size=1 << 20)  # type: ignore[return-value]


class _Chunks(io.RawIOBase):
    """A readable file over an iterator of byte chunks, for boto3's streamed multipart upload."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._left = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._left:
            self._left = next(self._chunks, b"")
            if not self._left:
                return 0
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()  # the generator's finally closes the checkpoint's files
        super().close()
