"""Checkpoint paths and atomic checkpoint directories.

On disk: `<checkpoint_dir>/<tenant>/<run_id>/<weights|sampler_weights|external_weights>/<name>/`. A checkpoint is
written into a hidden temp directory next to its final place, its metadata file is written last, and
the directory is renamed into place, so a reader never sees half a checkpoint. Names are never
reused: a sampler snapshot path keeps meaning the weights it was first written with.

Clients name checkpoints `tinker://<run_id>/<kind>/<name>` (Tinker SDK) or `twinkle://...`; both
are accepted everywhere and resolve inside the caller's own tenant directory only.

A checkpoint's merged export (twinkle.merged_export) lives beside it, in
`<checkpoint_dir>/<tenant>/<run_id>/merged/<kind>/<name>/`, committed the same way (its record file written
last), and goes when the checkpoint is deleted or overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from twinkle.errors import InvalidRequest, NotFound, StorageFailure

# external_weights: the PEFT adapter files alone (maybe age-encrypted), made to be downloaded
Kind = Literal["weights", "sampler_weights", "external_weights"]
CHECKPOINT_TYPES: dict[str, str] = {"weights": "training", "sampler_weights": "sampler",
                                    "external_weights": "external"}
METADATA_FILE = "checkpoint_metadata.json"
MERGED_ROOT = "merged"  # <tenant>/<run>/merged/<kind>/<name>/: the checkpoint's merged export
MERGED_RECORD = "merged_export.json"  # the merged export's record, written last
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:=+-]{0,199}$")
SCHEMES = ("tinker://", "twinkle://")


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    kind: Kind
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return CHECKPOINT_TYPES[self.kind]

    def uri(self, scheme: str = "tinker") -> str:
        return f"{scheme}://{self.run_id}/{self.kind}/{self.name}"


def validate_name(name: str, what: str = "checkpoint name") -> str:
    if not _NAME.fullmatch(name) or ".." in name:  # fullmatch: `$` alone lets a trailing newline in
        raise InvalidRequest(
            f"Invalid {what} {name!r}.",
            hint="Use 1-200 letters, digits and . _ - : = + (no '/', no '..', not starting with '.').",
        )
    return name


def parse_checkpoint_path(path: str) -> CheckpointRef:
    """Parse `tinker://run/kind/name` or `twinkle://run/kind/name`; anything else is a user error."""
    scheme = next((s for s in SCHEMES if path.startswith(s)), None)
    if scheme is None:
        raise InvalidRequest(
            f"Unsupported checkpoint path {path!r}.",
            hint="Use the tinker://<run>/weights/<name> path returned by save_state (twinkle:// works too).",
        )
    parts = path[len(scheme) :].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_TYPES:
        raise InvalidRequest(
            f"Malformed checkpoint path {path!r}.",
            hint="Expected <scheme>://<run_id>/<weights|sampler_weights|external_weights>/<name>.",
        )
    run_id, kind, name = parts
    validate_name(run_id, "run id")
    validate_name(name)
    return CheckpointRef(run_id, kind, name)  # type: ignore[arg-type]


def index_entry(ref: CheckpointRef, metadata: dict[str, Any], ttl_seconds: int | None) -> dict[str, Any]:
    """The RestClient's `Checkpoint` for a committed checkpoint, as the index in Redis keeps it."""
    now = time.time()
    return {
        "checkpoint_id": ref.checkpoint_id,
        "checkpoint_type": ref.checkpoint_type,
        "time": datetime.fromtimestamp(now, UTC).isoformat(),
        "tinker_path": ref.uri(),
        "size_bytes": metadata.get("size_bytes"),
        "public": False,
        "user_metadata": metadata.get("user_metadata") or None,
        "expires_at": datetime.fromtimestamp(now + ttl_seconds, UTC).isoformat() if ttl_seconds else None,
        **({"export": metadata["export"]} if metadata.get("export") else {}),
    }


def new_checkpoint_name(prefix: str = "ckpt") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


class CheckpointStore:
    """Filesystem side of checkpoints, confined per tenant."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def tenant_dir(self, owner: str) -> Path:
        validate_name(owner, "tenant id")
        return self.root / owner

    def path_of(self, owner: str, ref: CheckpointRef) -> Path:
        tenant = self.tenant_dir(owner)
        final = tenant / ref.run_id / ref.kind / ref.name
        # names are validated, so only a planted symlink could point outside the tenant's directory
        if not final.resolve().is_relative_to(tenant.resolve()):
            raise NotFound(f"Checkpoint {ref.uri()} not found.")
        return final

    def existing(self, owner: str, ref: CheckpointRef) -> Path:
        """The directory of a committed checkpoint of this tenant, or NotFound."""
        final = self.path_of(owner, ref)
        if final.is_symlink() or not _plain_file(final / METADATA_FILE):
            raise NotFound(
                f"Checkpoint {ref.uri()} not found.",
                hint="List your checkpoints with the RestClient (list_checkpoints) to see valid paths.",
            )
        return final

    def exists(self, owner: str, ref: CheckpointRef) -> bool:
        return _plain_file(self.path_of(owner, ref) / METADATA_FILE)

    def begin(self, owner: str, ref: CheckpointRef) -> Path:
        """A fresh temp directory to write a checkpoint into before `commit`."""
        final = self.path_of(owner, ref)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{ref.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def commit(self, owner: str, ref: CheckpointRef, tmp: Path, metadata: dict[str, Any], *,
               overwrite: bool = False) -> dict[str, Any]:
        """Write metadata last, then move the directory into place atomically."""
        final = self.path_of(owner, ref)
        metadata = dict(metadata, size_bytes=_size_of(tmp))
        _write_json_atomic(tmp / METADATA_FILE, metadata)
        if final.exists():
            if not overwrite or ref.kind != "weights":
                shutil.rmtree(tmp, ignore_errors=True)
                raise InvalidRequest(
                    f"Checkpoint {ref.uri()} already exists.",
                    hint="Choose a new name (sampler snapshots are immutable), or pass overwrite=True for "
                    "training checkpoints.",
                )
            trash = final.parent / f".old-{ref.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
            self.delete_merged(owner, ref)  # merged from the weights just replaced
        else:
            os.rename(tmp, final)
        return metadata

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def delete(self, owner: str, ref: CheckpointRef) -> None:
        final = self.existing(owner, ref)
        trash = final.parent / f".del-{ref.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
        self.delete_merged(owner, ref)

    def metadata(self, owner: str, ref: CheckpointRef) -> dict[str, Any]:
        path = self.existing(owner, ref) / METADATA_FILE
        try:
            return _read_json(path)
        except (OSError, ValueError) as exc:
            raise NotFound(f"Checkpoint {ref.uri()} not found.") from exc

    def update_metadata(self, owner: str, ref: CheckpointRef, changes: dict[str, Any], *, saved_at: Any) -> bool:
        """Add `changes` to the metadata of the checkpoint saved at `saved_at` (its metadata's `time`); False,
        and nothing written, when the checkpoint is gone or was overwritten since."""
        try:
            metadata = self.metadata(owner, ref)
        except NotFound:
            return False
        if metadata.get("time") != saved_at:
            return False
        if any(metadata.get(key) != value for key, value in changes.items()):
            _write_json_atomic(self.existing(owner, ref) / METADATA_FILE, {**metadata, **changes})
        return True

    # The checkpoint's merged export (twinkle.merged_export), beside it.

    def merged_path(self, owner: str, ref: CheckpointRef) -> Path:
        tenant = self.tenant_dir(owner)
        final = tenant / ref.run_id / MERGED_ROOT / ref.kind / ref.name
        if not final.resolve().is_relative_to(tenant.resolve()):
            raise NotFound(f"Checkpoint {ref.uri()} not found.")
        return final

    def merged_record(self, owner: str, ref: CheckpointRef) -> dict[str, Any] | None:
        """The committed record of the checkpoint's merged export; None when it has none."""
        final = self.merged_path(owner, ref)
        if final.is_symlink() or not _plain_file(final / MERGED_RECORD):
            return None
        try:
            return _read_json(final / MERGED_RECORD)
        except (OSError, ValueError):
            return None

    def begin_merged(self, owner: str, ref: CheckpointRef) -> Path:
        final = self.merged_path(owner, ref)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{ref.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def commit_merged(self, owner: str, ref: CheckpointRef, tmp: Path, record: dict[str, Any]) -> None:
        """Write the record last, then move the export into place (replacing an older one)."""
        _write_json_atomic(tmp / MERGED_RECORD, record)
        final = self.merged_path(owner, ref)
        if final.exists() or final.is_symlink():
            self.delete_merged(owner, ref)
        os.rename(tmp, final)

    def delete_merged(self, owner: str, ref: CheckpointRef) -> None:
        final = self.merged_path(owner, ref)
        if not (final.exists() or final.is_symlink()):
            return
        trash = final.parent / f".del-{ref.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(final, trash)
        except FileNotFoundError:  # deleted meanwhile
            return
        if trash.is_symlink():
            trash.unlink()
        else:
            shutil.rmtree(trash, ignore_errors=True)


def _plain_file(path: Path) -> bool:
    """A regular file, not a symlink to one: metadata must never lead outside its checkpoint."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


_STORAGE_PROBLEMS = {
    errno.ENOSPC: ("is full (no space left on device)", "free space under storage.checkpoint_dir"),
    errno.EDQUOT: ("is over its disk quota", "raise the quota or free space under storage.checkpoint_dir"),
    errno.EROFS: ("is read-only", "remount storage.checkpoint_dir read-write"),
    errno.EACCES: ("refuses the server access (permission denied)",
                   "give the server's user write access to storage.checkpoint_dir"),
    errno.EPERM: ("refuses the server access (operation not permitted)",
                  "give the server's user write access to storage.checkpoint_dir"),
    errno.EIO: ("failed with an I/O error", "check the disk behind storage.checkpoint_dir"),
}


def storage_failure(exc: BaseException) -> StorageFailure | None:
    """What a full, read-only or inaccessible checkpoint disk means for the user, or None for other errors.
    The message names the condition, never the server's paths."""
    code = _storage_errno(exc)
    if code is None:
        return None
    condition, fix = _STORAGE_PROBLEMS[code]
    return StorageFailure(f"The server's checkpoint storage {condition}, so the checkpoint could not be written "
                          "or read.", hint=f"Nothing is wrong with your request: ask the operator to {fix}, "
                          "then retry.",
                          errno=errno.errorcode.get(code, ""))


# Writers that are not Python file objects report the errno only in their message: safetensors
# ("Os { code: 28, kind: StorageFull ... }"), torch.save ("file write failed"), numpy through zipfile.
_MESSAGES = {"No space left on device": errno.ENOSPC, "StorageFull": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
             "Read-only file system": errno.EROFS, "ReadOnlyFilesystem": errno.EROFS}


def _storage_errno(exc: BaseException) -> int | None:
    seen: BaseException | None = exc
    for _ in range(8):  # the exception and what it was raised from
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in _STORAGE_PROBLEMS:
            return int(seen.errno)
        text = str(seen)
        for fragment, code in _MESSAGES.items():
            if fragment in text:
                return code
        seen = seen.__cause__ or seen.__context__
    return None


def _read_json(path: Path) -> dict[str, Any]:
    # O_NOFOLLOW: a symlink planted after the caller's check is refused, not followed
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), encoding="utf-8") as f:
        result: dict[str, Any] = json.load(f)
    return result


def _size_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True))
    os.replace(tmp, path)
