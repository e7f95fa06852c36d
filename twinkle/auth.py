"""API keys: how a request's key becomes a tenant id.

Only SHA-256 hashes of keys are configured or stored. The tenant id derived from a key is a short,
one-way hash, so it can appear in state, logs and checkpoint paths without revealing the key.
With no keys configured (development), every distinct key is accepted as its own tenant.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from twinkle.errors import Unauthenticated


def hash_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def tenant_id(raw_key: str) -> str:
    return "t" + hashlib.sha256(b"twinkle-tenant:" + raw_key.encode()).hexdigest()[:20]


def read_keys_file(path: str | Path) -> set[str]:
    """One SHA-256 hex hash per line; blank lines and `#` comments ignored."""
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
    def __init__(self, key_hashes: set[str], keys_file: str | None = None) -> None:
        self._static = {h.lower() for h in key_hashes}
        self._keys_file = keys_file

    @property
    def dev_mode(self) -> bool:
        return not self._static and not self._keys_file

    def _allowed(self) -> set[str]:
        if self._keys_file:
            return self._static | read_keys_file(self._keys_file)
        return self._static

    def tenant_for(self, raw_key: str | None) -> str:
        if not raw_key:
            raise Unauthenticated(
                "This request has no API key.",
                hint="Send it as 'X-API-Key: <key>' or 'Authorization: Bearer <key>'.",
            )
        if not self.dev_mode and hash_key(raw_key) not in self._allowed():
            raise Unauthenticated("The API key is not valid.", hint="Ask the server operator for a key.")
        return tenant_id(raw_key)


def key_from_headers(x_api_key: str | None, authorization: str | None) -> str | None:
    if x_api_key:
        return x_api_key.strip()
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return None
