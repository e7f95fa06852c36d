"""Checkpoint downloads served by the API itself: signed URLs per file, and the whole checkpoint as a tar.

The owner asks with its API key (`get_external_weights_urls`, or GET `.../archive`, which redirects) and
gets URLs that work without a key until they expire, for urllib, curl or another machine. The download
routes stream from disk and re-check that the checkpoint still exists inside the signed tenant's directory.
With `storage.export_store` set, the same two calls answer presigned URLs of the bucket instead
(twinkle/export_store.py); the download routes then only serve URLs handed out before it was set.

A checkpoint's merged export (twinkle.merged_export) is offered the same way, once it is verified:
`.../merged_urls` (one URL per file) and `.../merged_archive` (a tar), served from `/downloads/.../merged/...`.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, StreamingResponse

from api.context import ApiContext
from api.deps import Ctx, Tenant
from api.responses.answer import described_by
from api.responses.downloads import (
    ARCHIVE_REDIRECT,
    FILE_DOWNLOAD,
    TAR_DOWNLOAD,
    MergedExportUrls,
    SignedUrls,
)
from api.services.downloads import archive_url, download_signer, merged_archive_url, merged_subject, signed_url
from twinkle import merged_export
from twinkle.checkpoints import CHECKPOINT_TYPES, MERGED_RECORD, METADATA_FILE, CheckpointRef, validate_name
from twinkle.errors import ExportVerificationFailed, InvalidRequest, NotFound
from twinkle.tar_stream import TarStream

router = APIRouter()
_EXCLUDED = frozenset({METADATA_FILE})  # Twinkle's bookkeeping, not part of the adapter
_MERGED_EXCLUDED = frozenset({MERGED_RECORD})  # nor of the merged model


def _ref(run_id: str, kind: str, name: str) -> CheckpointRef:
    if kind not in CHECKPOINT_TYPES:
        raise InvalidRequest(f"Unknown checkpoint kind {kind!r}.",
                             hint="Use weights/<name>, sampler_weights/<name> or external_weights/<name>.")
    return CheckpointRef(validate_name(run_id, "run id"), kind, validate_name(name))  # type: ignore[arg-type]


def _ref_of_id(run_id: str, checkpoint_id: str) -> CheckpointRef:
    kind, _, name = checkpoint_id.partition("/")
    return _ref(run_id, kind, name)


async def _owned_dir(ctx: ApiContext, tenant: str, ref: CheckpointRef) -> Path:
    await ctx.store.model(ref.run_id, tenant, active=False)  # another tenant's run: 404, like a missing one
    return ctx.checkpoints.existing(tenant, ref)


def _files(directory: Path, excluded: frozenset[str] = _EXCLUDED) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.relative_to(directory).as_posix() not in excluded)


def _merged(ctx: ApiContext, tenant: str, ref: CheckpointRef) -> tuple[Path, dict[str, Any]]:
    """The directory and record of the checkpoint's verified merged export; NotFound before export_merged made
    it, ExportVerificationFailed when it failed its check (never offered)."""
    saved_at = ctx.checkpoints.metadata(tenant, ref).get("time")
    record = ctx.checkpoints.merged_record(tenant, ref)
    if record is None or not merged_export.is_current(record, saved_at):
        raise NotFound(f"Checkpoint {ref.uri()} has no merged export yet.",
                       hint="Ask for one with export_merged (twinkle_client: client.export_merged(path)) and wait for "
                            "its future.")
    if record["status"] != merged_export.VERIFIED:
        raise ExportVerificationFailed(merged_export.failure_message(record))
    return ctx.checkpoints.merged_path(tenant, ref), record


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
            response_model=described_by(SignedUrls))
async def external_weights_urls(run_id: str, checkpoint_id: str, request: Request, ctx: Ctx, tenant: Tenant
                                ) -> dict[str, Any]:
    """One signed URL per file of the checkpoint (the SDK's `get_external_weights_urls`)."""
    ref = _ref_of_id(run_id, checkpoint_id)
    directory = await _owned_dir(ctx, tenant, ref)
    urls: dict[str, str] = {}
    expires = 0
    for name in await asyncio.to_thread(_files, directory):
        if ctx.export_store is not None:
            urls[name], expires = await asyncio.to_thread(ctx.export_store.file_url, tenant, ref, directory, name)
            continue
        urls[name], expires = signed_url(ctx, request, tenant, "download_file", f"{ref.uri()}/{name}",
                                      run_id=ref.run_id, kind=ref.kind, name=ref.name, file_path=name)
    expires = expires or int(datetime.now(UTC).timestamp()) + download_signer(ctx).ttl_seconds
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/archive", status_code=302,
            responses=ARCHIVE_REDIRECT)
async def checkpoint_archive(run_id: str, checkpoint_id: str, request: Request, ctx: Ctx, tenant: Tenant
                             ) -> Response:
    """302 to a signed URL of the checkpoint as one tar (the 0.25 SDK's archive call; curl -L works)."""
    ref = _ref_of_id(run_id, checkpoint_id)
    directory = await _owned_dir(ctx, tenant, ref)
    if ctx.export_store is not None:  # uploaded on the first ask, so this call may take as long as the upload
        url, expires = await asyncio.to_thread(ctx.export_store.archive_url, tenant, ref, directory,
                                               exclude=_EXCLUDED)
    else:
        url, expires = archive_url(ctx, request, tenant, ref)
    expires_iso = datetime.fromtimestamp(expires, UTC).isoformat()
    return Response(content=json.dumps({"url": url, "expires": expires_iso}), status_code=302,
                    media_type="application/json",
                    headers={"Location": url, "Expires": formatdate(expires, usegmt=True)})


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/merged_urls",
            response_model=described_by(MergedExportUrls))
async def merged_urls(run_id: str, checkpoint_id: str, request: Request, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    """One signed URL per file of the checkpoint's verified merged export, and the export's check."""
    ref = _ref_of_id(run_id, checkpoint_id)
    await _owned_dir(ctx, tenant, ref)
    directory, record = await asyncio.to_thread(_merged, ctx, tenant, ref)
    urls: dict[str, str] = {}
    expires = 0
    for name in await asyncio.to_thread(_files, directory, _MERGED_EXCLUDED):
        if ctx.export_store is not None:
            urls[name], expires = await asyncio.to_thread(ctx.export_store.merged_file_url, tenant, ref, directory,
                                                          name)
            continue
        urls[name], expires = signed_url(ctx, request, tenant, "download_merged_file", merged_subject(ref, name),
                                         run_id=ref.run_id, kind=ref.kind, name=ref.name, file_path=name)
    expires = expires or int(datetime.now(UTC).timestamp()) + download_signer(ctx).ttl_seconds
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat(),
            "export": merged_export.summary(record)}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/merged_archive", status_code=302,
            responses=ARCHIVE_REDIRECT)
async def merged_archive(run_id: str, checkpoint_id: str, request: Request, ctx: Ctx, tenant: Tenant) -> Response:
    """302 to a signed URL of the verified merged export as one tar (`curl -L` works)."""
    ref = _ref_of_id(run_id, checkpoint_id)
    await _owned_dir(ctx, tenant, ref)
    directory, _ = await asyncio.to_thread(_merged, ctx, tenant, ref)
    if ctx.export_store is not None:
        url, expires = await asyncio.to_thread(ctx.export_store.merged_archive_url, tenant, ref, directory,
                                               exclude=_MERGED_EXCLUDED)
    else:
        url, expires = merged_archive_url(ctx, request, tenant, ref)
    expires_iso = datetime.fromtimestamp(expires, UTC).isoformat()
    return Response(content=json.dumps({"url": url, "expires": expires_iso}), status_code=302,
                    media_type="application/json",
                    headers={"Location": url, "Expires": formatdate(expires, usegmt=True)})


@router.get("/downloads/{run_id}/{kind}/{name}/merged/files/{file_path:path}", name="download_merged_file",
            response_class=FileResponse, responses=FILE_DOWNLOAD)
async def download_merged_file(run_id: str, kind: str, name: str, file_path: str, ctx: Ctx,
                               tenant: str = "", expires: str = "", signature: str = "") -> FileResponse:
    ref = _ref(run_id, kind, name)
    download_signer(ctx).verify(tenant, merged_subject(ref, file_path), expires, signature)
    directory, _ = await asyncio.to_thread(_merged, ctx, tenant, ref)
    return _file_response(directory, file_path, _MERGED_EXCLUDED, f"the merged export of {ref.uri()}")


@router.get("/downloads/{run_id}/{kind}/{name}/merged/archive.tar", name="download_merged_archive",
            response_class=StreamingResponse, responses=TAR_DOWNLOAD)
async def download_merged_archive(run_id: str, kind: str, name: str, ctx: Ctx,
                                  tenant: str = "", expires: str = "", signature: str = "") -> StreamingResponse:
    ref = _ref(run_id, kind, name)
    download_signer(ctx).verify(tenant, merged_subject(ref, "archive.tar"), expires, signature)
    directory, _ = await asyncio.to_thread(_merged, ctx, tenant, ref)
    return await _tar_response(directory, f"{ref.name}-merged", _MERGED_EXCLUDED,
                               f"{ref.run_id}-{ref.kind}-{ref.name}-merged.tar")


@router.get("/downloads/{run_id}/{kind}/{name}/files/{file_path:path}", name="download_file",
            response_class=FileResponse, responses=FILE_DOWNLOAD)
async def download_file(run_id: str, kind: str, name: str, file_path: str, ctx: Ctx,
                        tenant: str = "", expires: str = "", signature: str = "") -> FileResponse:
    ref = _ref(run_id, kind, name)
    download_signer(ctx).verify(tenant, f"{ref.uri()}/{file_path}", expires, signature)
    directory = ctx.checkpoints.existing(tenant, ref)
    return _file_response(directory, file_path, _EXCLUDED, f"checkpoint {ref.uri()}")


@router.get("/downloads/{run_id}/{kind}/{name}/archive.tar", name="download_archive",
            response_class=StreamingResponse, responses=TAR_DOWNLOAD)
async def download_archive(run_id: str, kind: str, name: str, ctx: Ctx,
                           tenant: str = "", expires: str = "", signature: str = "") -> StreamingResponse:
    ref = _ref(run_id, kind, name)
    download_signer(ctx).verify(tenant, f"{ref.uri()}/archive.tar", expires, signature)
    directory = ctx.checkpoints.existing(tenant, ref)
    return await _tar_response(directory, ref.name, _EXCLUDED, f"{ref.run_id}-{ref.kind}-{ref.name}.tar")


def _file_response(directory: Path, file_path: str, excluded: frozenset[str], what: str) -> FileResponse:
    """One file of a checkpoint or export directory. The signature covers the path, but never serve outside the
    directory, through a link, or its bookkeeping file."""
    path = directory / file_path
    if (file_path in excluded or path.is_symlink() or not path.is_file()
            or not path.resolve().is_relative_to(directory.resolve())):
        raise NotFound(f"{file_path} is not a file of {what}.")
    return FileResponse(path, media_type="application/octet-stream", filename=Path(file_path).name)


async def _tar_response(directory: Path, base: str, excluded: frozenset[str], filename: str) -> StreamingResponse:
    """The directory as a tar streamed under `base/`, its length known up front."""
    stream = await asyncio.to_thread(TarStream, directory, base, exclude=excluded)
    return StreamingResponse(stream.chunks(), media_type="application/x-tar", headers={
        "Content-Length": str(stream.content_length),
        "Content-Disposition": f'attachment; filename="{filename.replace(":", "_")}"'})
