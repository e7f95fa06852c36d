"""Answers of the download routes (api/routes/downloads.py, api/routes/tokenizer.py): signed URLs, the 302s to
a checkpoint's archive, and the files themselves."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from api.responses.answer import Answer
from api.responses.tinker import ExportCheck


class SignedUrls(Answer):
    urls: dict[str, str] = Field(description="Per file, a URL that works without a key until `expires`.")
    expires: str


class MergedExportUrls(SignedUrls):
    export: ExportCheck


class ArchiveLink(Answer):
    """The body of the 302 whose Location is the same signed URL."""

    url: str
    expires: str


class TokenizerFile(Answer):
    name: str
    size: int
    sha256: str


class TokenizerFiles(Answer):
    model_name: str
    files: list[TokenizerFile]


ARCHIVE_REDIRECT: dict[int | str, dict[str, Any]] = {302: {
    "model": ArchiveLink,
    "description": "To a signed URL of the archive (a tar), valid without a key until it expires; `curl -L` "
                   "follows it.",
    "headers": {"Location": {"schema": {"type": "string"}, "description": "The signed URL."},
                "Expires": {"schema": {"type": "string"}, "description": "When it stops working (HTTP date)."}},
}}
FILE_DOWNLOAD: dict[int | str, dict[str, Any]] = {200: {
    "description": "The file.",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}}
TAR_DOWNLOAD: dict[int | str, dict[str, Any]] = {200: {
    "description": "The directory as one tar, streamed (its Content-Length known up front).",
    "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
}}
