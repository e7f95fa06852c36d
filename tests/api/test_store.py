"""The API's view of the broker: when it started, so a request it lost reads as lost, not unknown."""

from __future__ import annotations

from api.store import broker_start_time


def test_the_broker_start_time_is_never_before_the_real_start_whatever_second_it_is_read_in() -> None:
    real_start = 1_000.7
    for tenths in range(1, 60):  # INFO read 0.1 s to 6 s after the start
        now = real_start + tenths / 10
        info = {"server_time_usec": int(now * 1e6), "uptime_in_seconds": int(now) - int(real_start)}
        assert real_start <= broker_start_time(info) <= real_start + 1


def test_a_request_accepted_just_before_a_restart_counts_as_before_it() -> None:
    # the case that read as `not_found`: accepted 0.2 s before a restart at x.9, checked at y.3
    accepted, restarted = 1_000.7, 1_000.9
    info = {"server_time_usec": int(1_004.3 * 1e6), "uptime_in_seconds": 1_004 - 1_000}
    assert accepted < broker_start_time(info)
    assert not accepted < 1_004.3 - info["uptime_in_seconds"]  # what `now - uptime` said
    assert restarted <= broker_start_time(info)
