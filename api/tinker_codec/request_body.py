"""The raw request body: size limit and Content-Encoding."""

from __future__ import annotations

import io

import zstandard

from twinkle.errors import InvalidRequest, PayloadTooLarge

_READ_SIZE = 1 << 20


def decoded_body(body: bytes, content_encoding: str | None, *, max_bytes: int) -> bytes:
    """The body with its Content-Encoding undone, refusing anything over `max_bytes` before or after."""
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"The request body is {len(body)} bytes; the limit is {max_bytes}.")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding == "zstd":
        return _zstd_decompressed(body, max_bytes=max_bytes)
    raise InvalidRequest(
        f"Content-Encoding {content_encoding!r} is not supported.",
        hint="Send the body uncompressed or with Content-Encoding: zstd.",
    )


def _zstd_decompressed(body: bytes, *, max_bytes: int) -> bytes:
    # Stream with a cap instead of trusting the frame header's content size: a tiny zstd frame can
    # expand to gigabytes (a decompression bomb).
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True)
        with reader:
            while piece := reader.read(_READ_SIZE):
                out += piece
                if len(out) > max_bytes:
                    raise PayloadTooLarge(f"The zstd body decompresses to more than {max_bytes} bytes, the limit.")
    except zstandard.ZstdError as exc:
        raise InvalidRequest(f"The body is not valid zstd data: {exc}.") from exc
    return bytes(out)
