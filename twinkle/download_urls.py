"""Signed, expiring, tenant-scoped download URLs for checkpoint files and archives.

A URL carries `tenant`, `expires` (unix seconds) and `signature` = HMAC-SHA256 over the three with the
URL's path, so it needs no API key: the Tinker SDK and tinker-cookbook fetch it with plain urllib. An
altered path, tenant or expiry, or a URL past its expiry, is refused (403). The key comes from the
config (`storage.download_secret`, the same on every API replica) or is generated once and kept next
to the checkpoints, which every API replica shares already.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from typing import Any

from twinkle.errors import Forbidden

SECRET_FILE = ".download_secret"  # tenant directories never start with a dot


class DownloadSigner:
    def __init__(self, secret: bytes, ttl_seconds: int) -> None:
        self._secret = secret
        self.ttl_seconds = ttl_seconds

    @classmethod
    def from_storage(cls, storage: Any) -> DownloadSigner:
        configured = getattr(storage, "download_secret", None)
        secret = configured.encode() if configured else stored_secret(Path(storage.checkpoint_dir))
        return cls(secret, int(getattr(storage, "download_url_ttl_seconds", 3600)))

    def _mac(self, tenant: str, path: str, expires: int) -> str:
        message = f"twinkle-download-v1\n{tenant}\n{path}\n{expires}".encode()
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def sign(self, tenant: str, path: str, *, now: float | None = None) -> tuple[dict[str, str], int]:
        """The query parameters that authorize GET `path` for `tenant`, and their expiry (unix seconds)."""
        expires = int(now if now is not None else time.time()) + self.ttl_seconds
        return {"tenant": tenant, "expires": str(expires), "signature": self._mac(tenant, path, expires)}, expires

    def verify(self, tenant: str, path: str, expires: str, signature: str, *, now: float | None = None) -> None:
        hint = "Ask the API for a new URL (get_external_weights_urls, or the checkpoint's archive route)."
        try:
            expires_at = int(expires)
        except ValueError:
            raise Forbidden("This download URL is malformed.", hint=hint) from None
        if not hmac.compare_digest(self._mac(tenant, path, expires_at), signature):
            raise Forbidden("This download URL's signature does not match it.", hint=hint)
        if expires_at < (now if now is not None else time.time()):
            raise Forbidden("This download URL has expired.", hint=hint)


def stored_secret(root: Path) -> bytes:
    """The secret in `<root>/.download_secret`, created on first use; concurrent creators agree on one."""
    path = root / SECRET_FILE
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{SECRET_FILE}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # atomic and refuses to replace: the first writer wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip().encode()
