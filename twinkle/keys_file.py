"""The keys file managed by `twinkle-server keys`: which API keys the server accepts, and their tiers.

One key per line, `<sha256 hex> [<label or -> [<created, ISO 8601 UTC, or -> [tier=<name>] [weight=<number>]]]`;
blank lines and `#` comments are ignored. `tier` names one of the config's `tenancy.tiers` (none: the default
tier) and `weight` overrides that tier's fair-share weight for this key alone. `twinkle.auth.read_keys_file`
reads only the first field, so a file of bare hashes (written by hand or by an older Twinkle) stays valid.
Only hashes are stored: the raw key is printed once by `add` and never written anywhere.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import re
import secrets
import string
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from twinkle.auth import hash_key
from twinkle.errors import InvalidRequest, NotFound
from twinkle.tenancy import TIER_NAME

KEY_PREFIXES = ("tw-", "tml-")  # tml- is the prefix the unmodified Tinker SDK insists on
KEY_LENGTH = 32
MIN_HASH_PREFIX = 6
NO_LABEL = "-"
_ALPHABET = string.ascii_letters + string.digits
MAX_WEIGHT = 1000.0  # as a tier's (twinkle.config.tenancy.TierConfig.weight)
_LABEL = re.compile(r"^[A-Za-z0-9._@:+-]{1,64}$")
log = logging.getLogger("twinkle.auth")


@dataclass(frozen=True)
class KeyEntry:
    key_hash: str
    label: str = ""
    created: str = ""
    tier: str = ""  # "" = the config's tenancy.default_tier
    weight: float | None = None  # None = the tier's weight

    def line(self) -> str:
        options = [f"tier={self.tier}"] if self.tier else []
        if self.weight is not None:
            options.append(f"weight={self.weight:g}")
        created = self.created or (NO_LABEL if options else "")
        return " ".join((self.key_hash, self.label or NO_LABEL, created, *options)).rstrip()


def valid_tier_name(tier: str) -> str:
    if not TIER_NAME.match(tier):
        raise InvalidRequest(f"Invalid tier name {tier!r}.", hint="Use 1-64 letters, digits and . _ -.")
    return tier


def valid_weight(weight: float) -> float:
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise InvalidRequest(f"Invalid weight {weight!r}.",
                             hint=f"A weight is a number above 0 and at most {MAX_WEIGHT:g} (1 = an even share).")
    return float(weight)


def parse_line(line: str) -> KeyEntry | None:
    """The entry of one line, None for a blank or comment line. A malformed `tier=` or `weight=` is left
    out with a warning (the key stays valid, with its tier's defaults); unknown `name=value` fields are
    ignored, so a file written by a newer Twinkle still reads."""
    fields = line.split("#", 1)[0].split()
    if not fields:
        return None
    positional = [f for f in fields[1:] if "=" not in f]
    label = positional[0] if positional and positional[0] != NO_LABEL else ""
    created = positional[1] if len(positional) > 1 and positional[1] != NO_LABEL else ""
    tier, weight = "", None
    for option in (f for f in fields[1:] if "=" in f):
        name, _, value = option.partition("=")
        try:
            if name == "tier":
                tier = valid_tier_name(value)
            elif name == "weight":
                weight = valid_weight(float(value))
        except (InvalidRequest, ValueError):
            log.warning("keys file: ignoring %r of key %s (%s)", option, fields[0][:12], label or "unlabelled")
    return KeyEntry(fields[0].lower(), label, created, tier, weight)


def new_raw_key(prefix: str = "tw-") -> str:
    if prefix not in KEY_PREFIXES:
        raise InvalidRequest(f"Unknown key prefix {prefix!r}.", hint=f"Use one of {', '.join(KEY_PREFIXES)}.")
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(KEY_LENGTH))


def read_entries(path: str | Path) -> list[KeyEntry]:
    """The file's entries in file order; a missing file has none."""
    p = Path(path)
    if not p.exists():
        return []
    return [entry for entry in map(parse_line, p.read_text().splitlines()) if entry is not None]


def add_key(path: str | Path, label: str = "", *, prefix: str = "tw-", tier: str = "",
            weight: float | None = None) -> tuple[str, KeyEntry]:
    """Generate a key, store its hash under `label` (in `tier`, with its own `weight` if given); returns the
    raw key (shown once) and its entry."""
    if label and (not _LABEL.match(label) or label == NO_LABEL):
        raise InvalidRequest(f"Invalid label {label!r}.", hint="Use 1-64 letters, digits and . _ @ : + -.")
    if tier:
        valid_tier_name(tier)
    if weight is not None:
        weight = valid_weight(weight)
    raw = new_raw_key(prefix)
    created = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    entry = KeyEntry(hash_key(raw), label, created, tier, weight)
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
        matched = _select(entries, selector)
        _write(path, [e for e in entries if e not in matched])
    return matched


def set_tier(path: str | Path, selector: str, *, tier: str | None = None, weight: float | None = None) -> KeyEntry:
    """Change the tier and/or own weight of the key `selector` names (as `revoke` finds it). `tier` ""
    (or "-") puts the key back in the default tier and `weight` 0 drops its own weight (its tier's applies);
    None leaves either as it is. Running servers apply the change within about a second."""
    if tier:
        tier = "" if tier == NO_LABEL else valid_tier_name(tier)
    if weight:
        weight = valid_weight(weight)
    with _locked(path):
        entries = read_entries(path)
        matched = _select(entries, selector)
        if len(matched) > 1:
            raise InvalidRequest(f"{len(matched)} keys are labelled {selector!r}.", hint="Select it by its hash.")
        old = matched[0]
        new = replace(old, tier=old.tier if tier is None else tier,
                      weight=old.weight if weight is None else (weight or None))
        _write(path, [new if e is old else e for e in entries])
    return new


def _select(entries: Iterable[KeyEntry], selector: str) -> list[KeyEntry]:
    """The key labelled `selector`, else the one key whose hash starts with it (at least 6 hex digits)."""
    entries = list(entries)
    matched = [e for e in entries if selector and e.label == selector]
    if matched:
        return matched
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
    return matched


def _write(path: str | Path, entries: list[KeyEntry]) -> None:
    """Write atomically (the API never reads half a file) and readable by the owner only."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    header = ("# Twinkle API keys: <sha256 of the key> <label> <created> [tier=<name>] [weight=<number>]. "
              "Managed by `twinkle-server keys`.\n")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(header + "".join(e.line() + "\n" for e in entries))
    os.replace(tmp, p)


@contextmanager
def _locked(path: str | Path) -> Iterator[None]:
    """Serialize concurrent `keys add` / `keys set` / `keys revoke` on one file."""
    lock = Path(path).with_name(f".{Path(path).name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
