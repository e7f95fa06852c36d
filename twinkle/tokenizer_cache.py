"""A client-side cache of the tokenizers a Twinkle server serves, for client machines without hub access.

`served_tokenizer("Qwen/Qwen3-8B")` downloads the tokenizer files the server lists under
`GET /api/v1/tokenizer_files` into `~/.cache/twinkle/tokenizers/` (once; checked by SHA-256) and loads
them with AutoTokenizer. `init_tinker_client()` routes the Tinker SDK's `get_tokenizer()` through it;
tinker-cookbook's `get_tokenizer(name)` uses it after
`tokenizer_utils.register_tokenizer(name, lambda: served_tokenizer(name))`.

The server is found as the SDK finds it: `TINKER_BASE_URL` and `TINKER_API_KEY` (which
`init_tinker_client` sets from `TWINKLE_SERVER_URL` / `TWINKLE_SERVER_TOKEN`), unless passed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("twinkle.tokenizer_cache")
API_PREFIX = "/api/v1"
_COMPLETE = ".complete"


def default_cache_dir() -> Path:
    return Path(os.environ.get("TWINKLE_TOKENIZER_CACHE") or Path.home() / ".cache" / "twinkle" / "tokenizers")


def fetch_tokenizer_files(model_name: str, *, base_url: str | None = None, api_key: str | None = None,
                          cache_dir: Path | None = None, timeout: float = 60.0) -> Path | None:
    """The local directory holding the server's tokenizer files for `model_name`, downloading them if needed.

    None when no server is configured or the server serves no tokenizer for that name (the caller then
    loads it some other way); an unreachable server is logged and also gives None.
    """
    base = (base_url or os.environ.get("TINKER_BASE_URL") or "").rstrip("/").removesuffix(API_PREFIX)
    key = api_key or os.environ.get("TINKER_API_KEY")
    if not base or not key:
        return None
    headers = {"X-API-Key": key}
    try:
        with httpx.Client(base_url=base + API_PREFIX, headers=headers, timeout=timeout) as http:
            listing = http.get("/tokenizer_files", params={"model": model_name})
            if listing.status_code in (400, 404):  # not served here (unknown model or no files)
                return None
            listing.raise_for_status()
            files = listing.json()["files"]
            digest = hashlib.sha256("".join(f"{f['name']}:{f['sha256']};" for f in files).encode()).hexdigest()
            target = (cache_dir or default_cache_dir()) / _safe(listing.json()["model_name"]) / digest[:16]
            if not (target / _COMPLETE).exists():
                _download(http, model_name, files, target)
            return target
    except (httpx.HTTPError, KeyError, ValueError) as error:
        log.warning("could not fetch the tokenizer of %r from %s: %s", model_name, base, error)
        return None


def served_tokenizer(model_name: str, **kwargs: Any) -> Any:
    """The server's tokenizer for `model_name`, loaded with transformers' AutoTokenizer."""
    directory = fetch_tokenizer_files(model_name, **kwargs)
    if directory is None:
        raise LookupError(f"The Twinkle server serves no tokenizer for {model_name!r} (or none is configured: "
                          "set TINKER_BASE_URL and TINKER_API_KEY, or call init_tinker_client first).")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _download(http: httpx.Client, model_name: str, files: list[dict[str, Any]], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        for entry in files:
            name = entry["name"]
            if "/" in name or name.startswith("."):
                raise ValueError(f"the server listed an unsafe file name {name!r}")
            response = http.get(f"/tokenizer_files/{name}", params={"model": model_name})
            response.raise_for_status()
            if hashlib.sha256(response.content).hexdigest() != entry["sha256"]:
                raise ValueError(f"{name} does not match the checksum the server listed")
            (staging / name).write_bytes(response.content)
        (staging / _COMPLETE).touch()
        if target.exists():  # a copy without its marker: left by a crash
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE).exists():  # else another process just finished the same download
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name).strip(".") or "model"
