"""Checkpoint names, metadata that is never read through a symlink, and what a full or read-only disk tells
the user."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from twinkle.checkpoints import CheckpointRef, CheckpointStore, storage_failure, validate_name
from twinkle.errors import InvalidRequest, NotFound, StorageFailure


@pytest.mark.parametrize("name", ["ckpt\n", "ckpt\r\n", "a\tb", "nul\x00", "esc\x1b", "new\nline", "..", ".hidden",
                                  "a/b", "x" * 201, ""])
def test_names_with_control_characters_or_path_parts_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequest):
        validate_name(name)


@pytest.mark.parametrize("name", ["ckpt-0001", "step_10", "a.b:c=d+e", "x" * 200])
def test_ordinary_names_are_accepted(name: str) -> None:
    assert validate_name(name) == name


def saved(store: CheckpointStore, owner: str, ref: CheckpointRef) -> None:
    tmp = store.begin(owner, ref)
    (tmp / "adapter.bin").write_bytes(b"weights")
    store.commit(owner, ref, tmp, {"base_model": "tiny"})


def test_a_metadata_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    ref = CheckpointRef("run", "weights", "step1")
    saved(store, "talice", ref)
    assert store.metadata("talice", ref)["base_model"] == "tiny"
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"base_model": "secret"}))
    metadata = store.path_of("talice", ref) / "checkpoint_metadata.json"
    metadata.unlink()
    metadata.symlink_to(outside)
    assert not store.exists("talice", ref)
    with pytest.raises(NotFound):
        store.metadata("talice", ref)
    with pytest.raises(NotFound):
        store.existing("talice", ref)


def test_a_full_device_is_reported_as_a_full_checkpoint_disk() -> None:
    with pytest.raises(OSError) as caught, open("/dev/full", "wb", buffering=0) as full:
        full.write(b"x" * 4096)
    failure = storage_failure(caught.value)
    assert isinstance(failure, StorageFailure) and failure.status_code == 507
    body = failure.to_dict()
    assert body["category"] == "server" and body["code"] == "storage_unavailable"
    assert "is full" in body["error"] and "/dev/full" not in body["error"] and "OSError" not in body["error"]


@pytest.mark.parametrize(("error", "fragment"), [
    (OSError(errno.EROFS, "Read-only file system", "/srv/ckpt/x"), "read-only"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "quota"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
    (RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'),
     "is full"),
])
def test_storage_errors_are_named_however_the_writer_reports_them(error: BaseException, fragment: str) -> None:
    failure = storage_failure(error)
    assert failure is not None and fragment in str(failure) and "/srv" not in str(failure)


def test_an_error_raised_from_a_storage_error_is_recognised_and_others_are_not() -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("file write failed") from exc
    except RuntimeError as wrapped:
        assert storage_failure(wrapped) is not None
    assert storage_failure(ValueError("bad")) is None
    assert storage_failure(OSError(errno.ENOENT, "No such file")) is None
