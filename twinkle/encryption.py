"""age encryption of exported weights (`save_weights_external(age_encryption_recipients=...)`).

The Tinker SDK's contract: every exported file is encrypted to all the recipients and stored with a
`.age` suffix; the client decrypts with `age -d -i <identity>`. tinker-cookbook's `weights.download`
of a training checkpoint relies on it (it exports to a key it generates for the download).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twinkle.errors import InvalidRequest

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10  # the SDK's documented limit


def parse_recipients(recipients: Sequence[str]) -> list[Any]:
    """pyrage recipients for native `age1...` keys and SSH public keys; a bad one is the user's error."""
    import pyrage

    if len(recipients) > MAX_RECIPIENTS:
        raise InvalidRequest(f"{len(recipients)} age recipients given; at most {MAX_RECIPIENTS} are allowed.")
    parsed: list[Any] = []
    for text in recipients:
        text = text.strip()
        try:
            if text.startswith("age1"):
                parsed.append(pyrage.x25519.Recipient.from_str(text))
            else:
                parsed.append(pyrage.ssh.Recipient.from_str(text))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # RecipientError, ValueError, or a Rust panic (a BaseException)
            raise InvalidRequest(
                f"Invalid age recipient {text[:40]!r}: {exc}.",
                hint="Pass native age public keys (age1...) or SSH public keys (ssh-ed25519 / ssh-rsa ...).",
            ) from exc
    return parsed


def encrypt_directory(directory: Path, recipients: Sequence[str]) -> None:
    """Replace every file under `directory` by `<file>.age`, encrypted to all `recipients`."""
    import pyrage

    parsed = parse_recipients(recipients)
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        target = path.with_name(path.name + AGE_SUFFIX)
        pyrage.encrypt_file(str(path), str(target), parsed)
        path.unlink()
