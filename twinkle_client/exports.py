"""Merged exports on the client: ask the server to merge a checkpoint's LoRA into the base weights, and download
the verified Hugging Face model directory it offers (`TwinkleClient.export_merged` / `download_merged`, or
`twinkle-server export-merged PATH DIR`).

The files come from signed URLs that need no API key (the API's own, or an S3-compatible bucket's); they are
written into a hidden directory beside the target and renamed into place once all of them arrived, so the
target never holds half a model.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path, PurePosixPath

import httpx

from twinkle_client.errors import InvalidArgument, TwinkleClientError

CHUNK = 1 << 20
SCHEMES = ("tinker://", "twinkle://")


def checkpoint_parts(path: str) -> tuple[str, str]:
    """`(run_id, checkpoint_id)` of a `tinker://` or `twinkle://` checkpoint path."""
    scheme = next((s for s in SCHEMES if path.startswith(s)), None)
    parts = path[len(scheme):].split("/") if scheme else []
    if len(parts) != 3 or not all(parts):
        raise InvalidArgument(f"Not a checkpoint path: {path!r}. Use the twinkle://<run>/<kind>/<name> path a save "
                              "returned (list_checkpoints shows them).")
    return parts[0], f"{parts[1]}/{parts[2]}"


def download_files(urls: dict[str, str], directory: str | os.PathLike[str], *, overwrite: bool = False,
                   timeout: float = 300.0) -> Path:
    """Fetch every `name: url` into `directory` (made; refused when it holds files, unless `overwrite`)."""
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise InvalidArgument(f"{str(target)!r} exists and is not empty; pass overwrite=True (--overwrite) to "
                              "replace it.")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), follow_redirects=True) as http:
            for name, url in sorted(urls.items()):
                destination = staging / _relative(name)
                destination.parent.mkdir(parents=True, exist_ok=True)
                with http.stream("GET", url) as response:
                    if response.status_code != 200:
                        response.read()
                        raise TwinkleClientError(f"Downloading {name} failed with HTTP {response.status_code}: "
                                                 f"{response.text[:300]}")
                    with destination.open("wb") as out:
                        for chunk in response.iter_bytes(CHUNK):
                            out.write(chunk)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _relative(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise TwinkleClientError(f"The server offered a file outside the download directory: {name!r}.")
    return path
