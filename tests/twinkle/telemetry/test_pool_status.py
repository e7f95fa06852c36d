"""The launcher's status line per pool: loading, ready, adapters held, queue depth; quiet when unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from twinkle.keys import Keys
from twinkle.telemetry.pool_status import PoolStatusPrinter


@dataclass
class FakePool:
    queue: str | None
    started_at: float = 0.0
    up: bool = True

    def alive(self) -> bool:
        return self.up


def test_status_lines_show_loading_then_ready_with_adapters_and_queue_and_stay_quiet_when_unchanged(
        r: redis.Redis) -> None:
    keys = Keys("")
    now = [100.0]
    lines: list[str] = []
    printer = PoolStatusPrinter(r, keys, interval=30, out=lines.append, clock=lambda: now[0])
    model, sampler, api = FakePool("model.m.0", started_at=55.0), FakePool("sampler.s", started_at=55.0), FakePool(None)
    pools = [model, sampler, api]
    printer.maybe_print(pools)
    assert lines == []  # not due yet
    now[0] = 130.0
    printer.maybe_print(pools)
    assert lines == ["[twinkle] pool model.m.0: loading model (75 s), 0 adapters, queue 0",
                     "[twinkle] pool sampler.s: loading model (75 s), queue 0"]
    r.set(keys.pool_heartbeat("model.m.0"), "{}")
    r.set(keys.pool_heartbeat("sampler.s"), "{}")
    r.sadd(keys.pool_adapters("model.m.0"), "s1:train:0", "s2:train:0", "s3:train:0")
    r.rpush("model.m.0", "op1", "op2")
    lines.clear()
    now[0] = 160.0
    printer.maybe_print(pools)
    assert lines == ["[twinkle] pool model.m.0: ready, 3 adapters, queue 2", "[twinkle] pool sampler.s: ready, queue 0"]
    lines.clear()
    now[0] = 190.0
    printer.maybe_print(pools)
    assert lines == []  # nothing changed
    sampler.up = False
    now[0] = 220.0
    printer.maybe_print(pools)
    assert lines == ["[twinkle] pool sampler.s: restarting, queue 0"]


def test_a_broker_outage_does_not_break_the_launcher_loop() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    lines: list[str] = []
    printer = PoolStatusPrinter(dead, Keys(""), interval=0, out=lines.append)
    printer.maybe_print([FakePool("model.m.0")])
    assert lines == []
