"""Remote encode: trajectories become InputFeatures on the server's processor pool, chunk by chunk.

The rows are cut into chunks, and each chunk is one `POST /twinkle/encode` request with its own
future. Several chunks are in flight at once so that the pool's workers encode them in parallel; the
features are put back together in the order of the rows, and a progress bar counts the encoded rows.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from twinkle_client.client import TwinkleClient
from twinkle_client.errors import FutureTimeout, InvalidArgument, TwinkleClientError
from twinkle_client.futures import TwinkleFuture

DEFAULT_TIMEOUT = 600.0
MAX_CHUNK_ROWS = 256


def chunk_ranges(total: int, chunk_size: int) -> list[range]:
    return [range(start, min(start + chunk_size, total)) for start in range(0, total, chunk_size)]


def default_chunk_size(total: int, in_flight: int) -> int:
    """About two chunks per request slot, so no worker idles at the end; bounded so bodies stay small."""
    return max(1, min(MAX_CHUNK_ROWS, math.ceil(total / (2 * in_flight))))


def encode_remotely(
    client: TwinkleClient,
    rows: Sequence[Mapping[str, Any]],
    template: str,
    template_kwargs: Mapping[str, Any],
    *,
    add_generation_prompt: bool = False,
    num_proc: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    chunk_size: int | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """The encoded rows (InputFeature JSON) of `rows` (Trajectory JSON), in order.

    `num_proc` sets how many chunks are encoded at once (twice that many are kept in flight); `timeout`
    bounds the whole encode, in seconds.
    """
    if num_proc < 1:
        raise InvalidArgument(f"num_proc must be at least 1, got {num_proc}.")
    if timeout <= 0:
        raise InvalidArgument(f"timeout must be positive, got {timeout}.")
    in_flight = 2 * num_proc
    size = chunk_size or default_chunk_size(len(rows), in_flight)
    if size < 1:
        raise InvalidArgument(f"chunk_size must be at least 1, got {chunk_size}.")
    chunks = chunk_ranges(len(rows), size)
    deadline = time.monotonic() + timeout
    pending: deque[tuple[range, TwinkleFuture[list[dict[str, Any]]]]] = deque()
    features: list[dict[str, Any]] = []
    submitted = 0
    with tqdm(
        total=len(rows), desc="Encode (remote)", unit="rows", file=sys.stderr, disable=not progress
    ) as bar:
        while submitted < len(chunks) or pending:
            while submitted < len(chunks) and len(pending) < in_flight:
                chunk = chunks[submitted]
                body = {
                    "template": template,
                    "template_kwargs": dict(template_kwargs),
                    "rows": [dict(row) for row in rows[chunk.start : chunk.stop]],
                    "add_generation_prompt": add_generation_prompt,
                }
                pending.append(
                    (
                        chunk,
                        client.submit("/twinkle/encode", body, _features, label="encode", show_queue=False),
                    )
                )
                submitted += 1
            chunk, future = pending.popleft()
            try:
                encoded = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                suggested = max(3600, int(timeout * 4))
                raise FutureTimeout(
                    f"Remote encode of {len(rows)} rows did not finish within {timeout:g} s "
                    f"({len(features)} rows encoded). Pass a larger timeout, e.g. "
                    f"dataset.encode(batched=True, num_proc={num_proc}, timeout={suggested})."
                ) from None
            if len(encoded) != len(chunk):
                raise TwinkleClientError(
                    f"The server encoded {len(encoded)} rows of a chunk of {len(chunk)} (rows {chunk.start}-"
                    f"{chunk.stop - 1}); encode must return one feature per row."
                )
            features.extend(encoded)
            bar.update(len(chunk))
    return features


def _features(reply: dict[str, Any]) -> list[dict[str, Any]]:
    features = reply["features"]
    if not isinstance(features, list):
        raise TypeError(f"features is a {type(features).__name__}, not a list")
    return features
