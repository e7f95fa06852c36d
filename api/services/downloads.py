"""Signed download URLs of checkpoints and their merged exports, for the download routes and the console.

A URL works without an API key until it expires; the download routes (api/routes/downloads.py) verify it.
"""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import Request

from api.context import ApiContext
from twinkle.checkpoints import CheckpointRef
from twinkle.download_urls import DownloadSigner


def download_signer(ctx: ApiContext) -> DownloadSigner:
    if ctx.downloads is None:  # built on first use: it may create the secret file next to the checkpoints
        ctx.downloads = DownloadSigner.from_storage(ctx.config.storage)
    return ctx.downloads


def merged_subject(ref: CheckpointRef, member: str) -> str:
    return f"merged:{ref.uri()}/{member}"  # never a subject of the checkpoint's own files


def _absolute(ctx: ApiContext, request: Request, route: str, **params: str) -> str:
    url = str(request.url_for(route, **params))
    public = ctx.config.storage.public_url
    if public:  # behind a proxy: the host clients know, not the one this process sees
        url = public.rstrip("/") + url[len(str(request.base_url).rstrip("/")):]
    return url


def signed_url(ctx: ApiContext, request: Request, tenant: str, route: str, subject: str, **params: str
            ) -> tuple[str, int]:
    query, expires = download_signer(ctx).sign(tenant, subject)
    return _absolute(ctx, request, route, **params) + "?" + urlencode(query), expires


def archive_url(ctx: ApiContext, request: Request, tenant: str, ref: CheckpointRef) -> tuple[str, int]:
    """The API's own signed URL of a checkpoint's tar (the archive call answers it, the console links it)."""
    return signed_url(ctx, request, tenant, "download_archive", f"{ref.uri()}/archive.tar",
                      run_id=ref.run_id, kind=ref.kind, name=ref.name)


def merged_archive_url(ctx: ApiContext, request: Request, tenant: str, ref: CheckpointRef) -> tuple[str, int]:
    """The API's own signed URL of a merged export's tar (the console links it)."""
    return signed_url(ctx, request, tenant, "download_merged_archive", merged_subject(ref, "archive.tar"),
                      run_id=ref.run_id, kind=ref.kind, name=ref.name)
