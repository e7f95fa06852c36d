"""The cleanup-leader lease: one holder at a time, handed over when the holder stops or dies."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from twinkle.keys import Keys
from twinkle.telemetry.leader import CleanupLeader, ServerGauges


def test_one_candidate_leads_and_another_takes_over_when_it_stops(r: redis.Redis,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="twinkle.telemetry")
    first, second = CleanupLeader(r, Keys(""), holder="a"), CleanupLeader(r, Keys(""), holder="b")
    assert first.try_lead() and not second.try_lead()
    assert first.try_lead()  # renewing keeps it
    assert "became cleanup leader (a)" in caplog.text and "(b)" not in caplog.text
    first.stop()
    assert second.try_lead()
    assert "became cleanup leader (b)" in caplog.text


def test_the_lease_expires_when_its_holder_stops_renewing(r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    dead, alive = CleanupLeader(r, Keys(""), lease_seconds=0.2, holder="dead"), CleanupLeader(r, Keys(""),
                                                                                              holder="alive")
    assert dead.try_lead()
    assert not alive.try_lead()
    time.sleep(0.3)
    assert alive.try_lead()
    assert not dead.try_lead() and not dead.is_leader
    assert "lost cleanup leadership (dead)" in caplog.text


def test_only_the_leader_publishes_the_server_gauges(r: redis.Redis) -> None:
    metrics = pytest.importorskip("opentelemetry.sdk.metrics")
    export = pytest.importorskip("opentelemetry.sdk.metrics.export")
    r.hset(Keys("").model("s1:train:0"), mapping={"status": "active"})
    r.rpush("model.m.0", "x")

    def published(leader: CleanupLeader) -> dict[str, list[tuple[dict[str, str], float]]]:
        reader = export.InMemoryMetricReader()
        meter = metrics.MeterProvider(metric_readers=[reader]).get_meter("test")
        ServerGauges(r, Keys(""), ["model.m.0"], leader=leader, min_interval=0).register(meter)
        data = reader.get_metrics_data()
        return {m.name: [(dict(p.attributes), p.value) for p in m.data.data_points]
                for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics for m in sm.metrics}

    leader, follower = CleanupLeader(r, Keys(""), holder="L"), CleanupLeader(r, Keys(""), holder="F")
    assert leader.try_lead() and not follower.try_lead()
    assert not any(published(follower).values())
    seen = published(leader)
    assert seen["twinkle.models.active"] == [({}, 1)]
    assert seen["twinkle.sessions.active"] == [({}, 0)]
    assert seen["twinkle.queue.depth"] == [({"queue": "model.m.0", "deployment": "Model"}, 1)]
