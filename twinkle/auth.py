"""API keys: how a request's key becomes a tenant id.

Only SHA-256 hashes of keys are configured or stored. The tenant id derived from a key is a short,
one-way hash, so it can appear in state, logs and checkpoint paths without revealing the key.
With no keys configured (development), every distinct key is accepted as its own tenant.
Each accepted key also has a policy (twinkle.tenancy): its tier's weight, quotas and training-run cap.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.errors import Unauthenticated
from twinkle.tenancy import Policies, TenantPolicy

if TYPE_CHECKING:
    from twinkle.config.tenancy import TenancyConfig

log = logging.getLogger("twinkle.auth")


def hash_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def tenant_id(raw_key: str) -> str:
    return "t" + hashlib.sha256(b"twinkle-tenant:" + raw_key.encode()).hexdigest()[:20]


def read_keys_file(path: str | Path) -> set[str]:
    """The first field of each line is a SHA-256 hex hash (see twinkle.keys_file for the rest); blank
    lines and `#` comments ignored."""
    p = Path(path)
    if not p.exists():
        return set()
    hashes = set()
    for line in p.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hashes.add(line.split()[0].lower())
    return hashes


class KeyChecker:
    """Accepts the configured hashes and those in the keys file, which is re-read when it changes, and
    resolves each key's policy (tier, weight, quotas) from the same file and `tenancy`.

    The file is stat'ed at most once per `recheck_seconds`, so `twinkle-server keys revoke` and `keys set`
    take effect within about a second, without a restart and without a syscall per request.
    """

    def __init__(self, key_hashes: set[str], keys_file: str | None = None, *, recheck_seconds: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, admin_hashes: set[str] | None = None,
                 tenancy: TenancyConfig | None = None) -> None:
        self._admins = frozenset(h.lower() for h in admin_hashes or ())
        self._static = {h.lower() for h in key_hashes} | self._admins
        self._keys_file = keys_file
        self._recheck_seconds = recheck_seconds
        self._clock = clock
        self._checked_at = -math.inf
        self._file_signature: tuple[int, int, int] | None = None
        self._accepted = frozenset(self._static)
        self.policies = Policies(tenancy)
        self._key_policies: dict[str, TenantPolicy] = {}  # keys of the file with a tier or weight of their own

    @property
    def dev_mode(self) -> bool:
        return not self._static and not self._keys_file

    def _allowed(self) -> frozenset[str]:
        if self._keys_file:
            now = self._clock()
            if now - self._checked_at >= self._recheck_seconds:
                self._checked_at = now
                self._reload_if_changed(self._keys_file)
        return self._accepted

    def _reload_if_changed(self, path: str) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            signature = None
        else:
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature == self._file_signature:
            return
        from twinkle.keys_file import read_entries  # deferred: twinkle.keys_file imports this module

        try:
            entries = read_entries(path) if signature else []
        except OSError as exc:  # unreadable for a moment: keep the keys we had rather than lock everyone out
            log.warning("keys file %s unreadable (%s); keeping the previous keys", path, exc)
            return
        unknown = self.policies.unknown(e.tier for e in entries)
        if unknown:
            log.warning("keys file %s names tiers the config's tenancy.tiers lacks (%s); those keys get the "
                        "default tier %r", path, ", ".join(unknown), self.policies.default_tier)
        self._file_signature = signature
        self._key_policies = {e.key_hash: self.policies.for_key(e.tier, e.weight) for e in entries
                              if e.tier or e.weight is not None}
        self._accepted = frozenset(self._static | {e.key_hash for e in entries})
        log.info("keys file %s loaded: %d keys accepted", path, len(self._accepted))

    def tenant_for(self, raw_key: str | None) -> str:
        return self.identify(raw_key)[0]

    def identify(self, raw_key: str | None) -> tuple[str, TenantPolicy]:
        """The tenant id of the key and its policy; Unauthenticated for a missing or unknown key."""
        if not raw_key:
            raise Unauthenticated(
                "This request has no API key.",
                hint="Send it as 'X-API-Key: <key>' or 'Authorization: Bearer <key>'.",
            )
        if self.dev_mode:
            return tenant_id(raw_key), self.policies.default
        key_hash = hash_key(raw_key)
        if key_hash not in self._allowed():
            raise Unauthenticated("The API key is not valid.", hint="Ask the server operator for a key.")
        return tenant_id(raw_key), self._key_policies.get(key_hash, self.policies.default)

    def is_admin(self, raw_key: str | None) -> bool:
        """Whether the key is an operator's (`auth.admin_keys`); never true in development mode."""
        return bool(raw_key) and hash_key(str(raw_key)) in self._admins


def key_from_headers(x_api_key: str | None, authorization: str | None) -> str | None:
    if x_api_key:
        return x_api_key.strip()
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return None
