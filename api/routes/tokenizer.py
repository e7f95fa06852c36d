"""Tokenizer files of the served models, so a client without hub access loads the server's tokenizer.

`GET /tokenizer_files?model=NAME` lists the files (name, size, sha256); `GET /tokenizer_files/{name}?model=NAME`
returns one. NAME is the served model name (`Qwen/Qwen3-8B`), any alias of it, or the `tokenizer_id` that
get_info returned. Any valid key may read them: they are the same for every tenant.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse

from api.deps import Ctx, Tenant
from api.responses.answer import described_by
from api.responses.downloads import FILE_DOWNLOAD, TokenizerFiles
from twinkle.catalog import ServedModel
from twinkle.errors import NotFound
from twinkle.tokenizer_files import TOKENIZER_FILE_NAMES, list_tokenizer_files, tokenizer_directory

router = APIRouter()


def _directory(served: ServedModel) -> Path:
    directory = tokenizer_directory(served.model_id)
    if directory is None:
        raise NotFound(
            f"This server has no tokenizer files for {served.name!r}.",
            hint="Load the tokenizer from its hub id, or ask the operator to serve the model from a local "
                 "directory (or a pre-filled hub cache) that holds its tokenizer files.",
        )
    return directory


@router.get("/tokenizer_files", response_model=described_by(TokenizerFiles))
async def tokenizer_files(model: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    served = ctx.catalog.find(model)
    directory = _directory(served)
    files = await asyncio.to_thread(list_tokenizer_files, directory)  # hashing reads the files
    return {"model_name": served.name, "files": [f.__dict__ for f in files]}


@router.get("/tokenizer_files/{name}", response_class=FileResponse, responses=FILE_DOWNLOAD)
async def tokenizer_file(name: str, model: str, ctx: Ctx, tenant: Tenant) -> FileResponse:
    served = ctx.catalog.find(model)
    if name not in TOKENIZER_FILE_NAMES:  # a fixed list: no path from the client reaches the filesystem
        raise NotFound(f"{name!r} is not a tokenizer file.", hint="List the files with GET tokenizer_files.")
    path = _directory(served) / name
    if not path.is_file():
        raise NotFound(f"The tokenizer of {served.name!r} has no {name!r}.",
                       hint="List the files with GET tokenizer_files.")
    return FileResponse(path, media_type="application/octet-stream")
