"""The keys file managed by `twinkle-server keys`: which API keys the server accepts.

One key per line, `<sha256 hex> [<label or -> [<created, ISO 8601 UTC>]]`; blank lines and `#` comments are
ignored. `twinkle.auth.read_keys_file` reads only the first field, so a file of bare hashes (written by
hand or by an older Twinkle) stays valid. Only hashes are stored: the raw key is printed once by
`add` and never written anywhere.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import string
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from twinkle.auth import hash_key
from twinkle.errors import InvalidRequest, NotFound

KEY_PREFIXES = ("tw-", "tml-")  # tml- is the prefix the unmodified Tinker SDK insists on
KEY_LENGTH = 32
MIN_HASH_PREFIX = 6
NO_LABEL = "-"
_ALPHABET = string.ascii_letters + string.digits
_LABEL = re.compile(r"^[A-Za-z0-9._@:+-]{1,64}$")


@dataclass(frozen=True)
class KeyEntry:
    key_hash: str
    label: str = ""
    created: str = ""

    def line(self) -> str:
        return " ".join((self.key_hash, self.label or NO_LABEL, self.created)).rstrip()


def new_raw_key(prefix: str = "tw-") -> str:
    if prefix not in KEY_PREFIXES:
        raise InvalidRequest(f"Unknown key prefix {prefix!r}.", hint=f"Use one of {', '.join(KEY_PREFIXES)}.")
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(KEY_LENGTH))


def read_entries(path: str | Path) -> list[KeyEntry]:
    """The file's entries in file order; a missing file has none."""
    p = Path(path)
    if not p.exists():
        return []
    entries = []
    for line in p.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            label = fields[1] if len(fields) > 1 and fields[1] != NO_LABEL else ""
            entries.append(KeyEntry(fields[0].lower(), label, fields[2] if len(fields) > 2 else ""))
    return entries


def add_key(path: str | Path, label: str = "", *, prefix: str = "tw-") -> tuple[str, KeyEntry]:
    """Generate a key, store its hash under `label`; returns the raw key (shown once) and its entry."""
    if label and (not _LABEL.match(label) or label == NO_LABEL):
        raise InvalidRequest(f"Invalid label {label!r}.", hint="Use 1-64 letters, digits and . _ @ : + -.")
    raw = new_raw_key(prefix)
    created = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    entry = KeyEntry(hash_key(raw), label, created)
    with _locked(path):
        entries = read_entries(path)
        if label and any(e.label == label for e in entries):
            raise InvalidRequest(f"A key labelled {label!r} already exists.",
                                 hint="Choose another label, or revoke the old key first.")
        _write(path, [*entries, entry])
    return raw, entry


def revoke(path: str | Path, selector: str) -> list[KeyEntry]:
    """Remove the key whose label is `selector`, else the one key whose hash starts with it."""
    with _locked(path):
        entries = read_entries(path)
        matched = [e for e in entries if selector and e.label == selector]
        if not matched:
            prefix = selector.lower()
            if len(prefix) < MIN_HASH_PREFIX or not all(c in string.hexdigits for c in prefix):
                raise NotFound(f"No key is labelled {selector!r}.",
                               hint=f"Pass a label or at least {MIN_HASH_PREFIX} hex digits of a hash "
                               "(see `twinkle-server keys list`).")
            matched = [e for e in entries if e.key_hash.startswith(prefix)]
            if len(matched) > 1:
                raise InvalidRequest(f"{len(matched)} keys start with {selector!r}.",
                                     hint="Give more digits of the hash, or the label.")
            if not matched:
                raise NotFound(f"No key matches {selector!r}.", hint="See `twinkle-server keys list`.")
        _write(path, [e for e in entries if e not in matched])
    return matched


def _write(path: str | Path, entries: list[KeyEntry]) -> None:
    """Write atomically (the API never reads half a file) and readable by the owner only."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    header = "# Twinkle API keys: <sha256 of the key> <label> <created>. Managed by `twinkle-server keys`.\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(header + "".join(e.line() + "\n" for e in entries))
    os.replace(tmp, p)


@contextmanager
def _locked(path: str | Path) -> Iterator[None]:
    """Serialize concurrent `keys add` / `keys revoke` on one file."""
    lock = Path(path).with_name(f".{Path(path).name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
