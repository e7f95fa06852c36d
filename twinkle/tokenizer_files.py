"""The tokenizer files of a served model: which files make a tokenizer, and where the server finds them.

The API serves them (`GET /tokenizer_files`) so a client machine without hub access can load the
tokenizer the server uses (see `twinkle.tokenizer_cache`). Only the files a tokenizer is made of are
listed, never weights. The directory is the model's own when `model_id` is a local directory, or the
server's local hub cache for a hub id (never a download: the API answers from what the operator
provided).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from twinkle.catalog import strip_scheme

# What AutoTokenizer reads (config.json names the tokenizer class when tokenizer_config.json does not).
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)
MAX_FILE_BYTES = 256 * 1024 * 1024  # the largest tokenizer.json files are a few tens of MiB


@dataclass(frozen=True)
class TokenizerFile:
    name: str
    size: int
    sha256: str


def is_hub_style_name(name: str) -> bool:
    """`org/name`, as the Tinker SDK and tinker-cookbook pass to AutoTokenizer (not a path, no scheme)."""
    if "://" in name or name.startswith(("/", ".", "~")) or name.count("/") != 1:
        return False
    org, model = name.split("/")
    return bool(org and model) and not os.path.exists(name)


def tokenizer_directory(model_id: str) -> Path | None:
    """The local directory with the model's tokenizer files, or None when this machine has none."""
    plain = Path(strip_scheme(model_id)).expanduser()
    if plain.is_dir():
        return plain if _names_in(plain) else None
    repo_id = strip_scheme(model_id)
    if model_id.startswith("ms://") or repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:  # the cached snapshot only: the API never downloads
        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub raises several error types for that)
        return None
    return snapshot if _names_in(snapshot) else None


def list_tokenizer_files(directory: Path) -> list[TokenizerFile]:
    files = []
    for name in _names_in(directory):
        data = (directory / name).read_bytes()
        files.append(TokenizerFile(name, len(data), hashlib.sha256(data).hexdigest()))
    return files


def _names_in(directory: Path) -> list[str]:
    names = []
    for name in TOKENIZER_FILE_NAMES:
        path = directory / name
        if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
            names.append(name)
    # config.json alone is no tokenizer
    return names if any(n not in ("config.json", "generation_config.json") for n in names) else []
