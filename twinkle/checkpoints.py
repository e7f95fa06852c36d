"""Checkpoint paths and atomic checkpoint directories.

On disk: `<checkpoint_dir>/<tenant>/<run_id>/<weights|sampler_weights>/<name>/`. A checkpoint is
written into a hidden temp directory next to its final place, its metadata file is written last, and
the directory is renamed into place, so a reader never sees half a checkpoint. Names are never
reused: a sampler snapshot path keeps meaning the weights it was first written with.

Clients name checkpoints `tinker://<run_id>/<kind>/<name>` (Tinker SDK) or `twinkle://...`; both
are accepted everywhere and resolve inside the caller's own tenant directory only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from twinkle.errors import InvalidRequest, NotFound

Kind = Literal["weights", "sampler_weights"]
CHECKPOINT_TYPES: dict[str, str] = {"weights": "training", "sampler_weights": "sampler"}
METADATA_FILE = "checkpoint_metadata.json"
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
    if not _NAME.match(name) or ".." in name:
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
            hint="Expected <scheme>://<run_id>/<weights|sampler_weights>/<name>.",
        )
    run_id, kind, name = parts
    validate_name(run_id, "run id")
    validate_name(name)
    return CheckpointRef(run_id, kind, name)  # type: ignore[arg-type]


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
        if final.is_symlink() or not (final / METADATA_FILE).is_file():
            raise NotFound(
                f"Checkpoint {ref.uri()} not found.",
                hint="List your checkpoints with the RestClient (list_checkpoints) to see valid paths.",
            )
        return final

    def exists(self, owner: str, ref: CheckpointRef) -> bool:
        return (self.path_of(owner, ref) / METADATA_FILE).is_file()

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
            if not overwrite or ref.kind == "sampler_weights":
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

    def metadata(self, owner: str, ref: CheckpointRef) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.existing(owner, ref) / METADATA_FILE).read_text())
        return result


def _size_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True))
    os.replace(tmp, path)
