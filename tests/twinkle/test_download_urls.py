"""Signed download URLs: what a signature covers, expiry, and the secret kept next to the checkpoints."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from twinkle.download_urls import SECRET_FILE, DownloadSigner, stored_secret
from twinkle.errors import Forbidden

PATH = "tinker://s1:train:0/external_weights/final/adapter_model.safetensors"


def test_a_signed_url_verifies_until_it_expires() -> None:
    signer = DownloadSigner(b"k" * 32, ttl_seconds=60)
    query, expires = signer.sign("tA", PATH, now=1000)
    assert expires == 1060 and query["expires"] == "1060"
    signer.verify("tA", PATH, query["expires"], query["signature"], now=1059)
    with pytest.raises(Forbidden, match="expired"):
        signer.verify("tA", PATH, query["expires"], query["signature"], now=1061)


@pytest.mark.parametrize("field", ["tenant", "path", "expires", "signature", "secret"])
def test_changing_anything_the_signature_covers_is_refused(field: str) -> None:
    signer = DownloadSigner(b"k" * 32, ttl_seconds=60)
    query, _ = signer.sign("tA", PATH, now=1000)
    args = {"tenant": "tA", "path": PATH, "expires": query["expires"], "signature": query["signature"]}
    if field == "secret":
        signer = DownloadSigner(b"j" * 32, ttl_seconds=60)
    elif field == "expires":
        args["expires"] = "999999"  # a later expiry is the classic tampering
    elif field == "signature":
        args["signature"] = args["signature"][:-2] + "AA"
    else:
        args[field] = args[field] + "x"
    with pytest.raises(Forbidden) as info:
        signer.verify(args["tenant"], args["path"], args["expires"], args["signature"], now=1000)
    assert info.value.status_code == 403


def test_a_generated_secret_is_created_once_private_and_reused(tmp_path: Path) -> None:
    first = stored_secret(tmp_path / "ckpts")
    assert len(first) == 64
    assert (tmp_path / "ckpts" / SECRET_FILE).stat().st_mode & 0o777 == 0o600
    assert stored_secret(tmp_path / "ckpts") == first
    assert [p.name for p in (tmp_path / "ckpts").iterdir()] == [SECRET_FILE]  # no temp files left


def test_a_configured_secret_wins_over_the_stored_one(tmp_path: Path) -> None:
    storage = SimpleNamespace(checkpoint_dir=str(tmp_path), download_secret="s" * 32, download_url_ttl_seconds=90)
    signer = DownloadSigner.from_storage(storage)
    query, _ = signer.sign("tA", PATH, now=0)
    DownloadSigner(b"s" * 32, 90).verify("tA", PATH, query["expires"], query["signature"], now=0)
    assert not (tmp_path / SECRET_FILE).exists()
