"""Server-wide counts the cleanup leader publishes, read from a real Redis."""

from __future__ import annotations

import json

import redis

from twinkle.keys import Keys
from twinkle.ledger.messages import UNACKED
from twinkle.telemetry.resources import count_resources, queue_depths


def test_only_live_resources_are_counted(r: redis.Redis) -> None:
    keys = Keys("")
    r.hset(keys.session("s1"), mapping={"owner": "t1"})
    r.hset(keys.session("s2"), mapping={"owner": "t1", "finished": "success"})
    r.hset(keys.model("s1:train:0"), mapping={"status": "active"})
    r.hset(keys.model("s1:train:1"), mapping={"status": "unloaded"})
    r.hset(keys.sampling_session("s1:sample:9"), mapping={"owner": "t1"})
    for i, status in enumerate(["queued", "running", "completed", "failed", "queued"]):
        r.hset(keys.future(f"f{i}"), mapping={"status": status})
    r.set(keys.blob_in("f0"), b"payload")  # not a resource, and not a hash
    r.hset(Keys("other:").session("s3"), mapping={"owner": "t2"})  # another deployment sharing the Redis
    counts = count_resources(r, keys)
    assert (counts.sessions, counts.models, counts.sampling_sessions, counts.futures) == (1, 1, 1, 3)


def test_queue_depth_counts_waiting_and_unacked_messages_per_queue(r: redis.Redis) -> None:
    r.rpush("model.m.0", "a", "b")
    r.rpush("sampler.s", "c")
    r.hset(UNACKED, mapping={"tag1": json.dumps([{}, "", "model.m.0"]), "tag2": json.dumps([{}, "", "elsewhere"]),
                             "tag3": "not json"})
    assert queue_depths(r, ["model.m.0", "sampler.s", "processor.p"]) == {"model.m.0": 3, "sampler.s": 1,
                                                                          "processor.p": 0}
