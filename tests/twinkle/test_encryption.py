"""age encryption of exported weights, as tinker-cookbook's weights.download decrypts them."""

from __future__ import annotations

from pathlib import Path

import pyrage
import pytest

from twinkle.encryption import encrypt_directory, parse_recipients
from twinkle.errors import InvalidRequest


def test_every_file_is_replaced_by_an_age_file_each_recipient_can_decrypt(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00\x01" * 1000)
    alice, bob = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    encrypt_directory(tmp_path, [str(alice.to_public()), str(bob.to_public())])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    for identity in (alice, bob):
        out = tmp_path / "out"
        pyrage.decrypt_file(str(tmp_path / "adapter_model.safetensors.age"), str(out), [identity])
        assert out.read_bytes() == b"\x00\x01" * 1000
        out.unlink()


@pytest.mark.parametrize("bad", ["age1notakey", "ssh-ed25519 AAAA", "hello"])
def test_a_malformed_recipient_is_a_user_error_naming_it(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="Invalid age recipient"):
        parse_recipients([bad])


def test_more_than_ten_recipients_are_refused() -> None:
    key = str(pyrage.x25519.Identity.generate().to_public())
    with pytest.raises(InvalidRequest, match="at most 10"):
        parse_recipients([key] * 11)
