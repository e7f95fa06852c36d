"""Tokens of a streamed sample request, published while the sampler generates them.

The API subscribes to the request's channel before it submits the op (the channel name is chosen by the
API, never by a client). Each message holds, per sample, the tokens that are new since the last message
and the offset they start at, so a subscriber that missed a message notices the gap and waits for the
op's final result instead (which it reads anyway: the stream is a preview, the result is authoritative).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import redis

log = logging.getLogger("twinkle.worker")


def token_publisher(r: redis.Redis, channel: str) -> Callable[[list[list[int]]], None]:
    sent: list[int] = []

    def publish(rows: list[list[int]]) -> None:
        while len(sent) < len(rows):
            sent.append(0)
        updates = [[sent[i], row[sent[i] :]] for i, row in enumerate(rows)]
        if not any(tokens for _, tokens in updates):
            return
        for i, row in enumerate(rows):
            sent[i] = len(row)
        try:
            r.publish(channel, json.dumps({"rows": updates}, separators=(",", ":")))
        except redis.RedisError as exc:  # the final result still reaches the client
            log.warning("stream update on %s lost: %s", channel, exc)

    return publish
