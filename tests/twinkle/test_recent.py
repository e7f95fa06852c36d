"""The bounded map of recently used entries."""

from __future__ import annotations

from twinkle.recent import Recent


def test_past_its_limit_the_least_recently_used_entry_goes() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    assert recent.get("a") == 1  # now b is the least recent
    recent.put("c", 3)
    assert (recent.get("a"), recent.get("b"), recent.get("c"), len(recent)) == (1, None, 3, 2)


def test_putting_an_entry_again_makes_it_the_most_recent_and_pop_takes_it_once() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    recent.put("a", 10)
    recent.put("c", 3)
    assert recent.get("b") is None and recent.pop("a") == 10 and recent.pop("a") is None
