"""Refusals past a key's free allowance per second are held; other keys and polite clients are not."""

from __future__ import annotations

import asyncio
import time

from api.tarpit import Tarpit


async def test_refusals_past_the_free_allowance_are_held_and_their_retry_after_shortened() -> None:
    tarpit = Tarpit(penalty_seconds=0.2, free_per_second=3)
    began = time.monotonic()
    free = [await tarpit.refuse("hammer", 0.5) for _ in range(3)]
    assert free == [0.5, 0.5, 0.5] and time.monotonic() - began < 0.1
    held = await tarpit.refuse("hammer", 0.5)
    assert held == 0.5 - 0.2 and time.monotonic() - began >= 0.2


async def test_another_key_is_answered_at_once_while_one_key_is_held() -> None:
    tarpit = Tarpit(penalty_seconds=0.3, free_per_second=1)
    await tarpit.refuse("hammer", 1.0)
    held = asyncio.create_task(tarpit.refuse("hammer", 1.0))
    began = time.monotonic()
    assert await tarpit.refuse("polite", 1.0) == 1.0
    assert time.monotonic() - began < 0.1 and not held.done()
    await held


async def test_no_more_than_max_held_answers_of_one_key_wait() -> None:
    tarpit = Tarpit(penalty_seconds=0.3, free_per_second=0, max_held=2)
    began = time.monotonic()
    answers = await asyncio.gather(*(tarpit.refuse("hammer", 1.0) for _ in range(4)))
    assert sorted(answers) == [0.7, 0.7, 1.0, 1.0]  # two held, two sent at once
    assert time.monotonic() - began < 0.6
