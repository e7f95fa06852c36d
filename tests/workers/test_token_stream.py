"""Streamed tokens: the pool publishes each sample's new tokens with their offset (real Redis pub/sub), and
the API's feed grows its previews from them, stopping a preview at a gap instead of garbling it."""

from __future__ import annotations

import json
import time
import uuid

import redis

from api.openai.token_feed import _apply
from tests.harness import REDIS_HOST, REDIS_PORT, require_redis
from workers.token_stream import token_publisher


def test_only_new_tokens_are_published_with_their_offsets() -> None:
    require_redis()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    channel = f"test-stream-{uuid.uuid4().hex}"
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    publish = token_publisher(r, channel)
    publish([[1], [7]])
    publish([[1, 2], [7]])
    publish([[1, 2], [7]])  # nothing new: nothing sent
    publish([[1, 2, 3], [7, 8, 9]])
    messages = []
    deadline = time.monotonic() + 5
    while len(messages) < 3 and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message:
            messages.append(json.loads(message["data"])["rows"])
    pubsub.close()
    r.close()
    assert messages == [[[0, [1]], [0, [7]]], [[1, [2]], [1, []]], [[2, [3]], [1, [8, 9]]]]


def test_a_preview_grows_in_order_and_stops_at_a_gap() -> None:
    rows: list[list[int]] = []
    stale: set[int] = set()
    assert _apply(rows, stale, json.dumps({"rows": [[0, [1, 2]], [0, [5]]]}))
    assert not _apply(rows, stale, json.dumps({"rows": [[3, [4]], [1, []]]}))  # sample 0 missed a message
    assert _apply(rows, stale, json.dumps({"rows": [[4, [5]], [1, [6]]]}))
    assert rows == [[1, 2], [5, 6]] and stale == {0}
    assert not _apply(rows, stale, b"not json")
