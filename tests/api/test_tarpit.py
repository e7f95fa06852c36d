"""Refusals past a key's free allowance are held; other keys, and a key whose allowance refilled, are not."""

from __future__ import annotations

import asyncio
import time

from api.tarpit import Tarpit


async def test_refusals_past_the_free_allowance_are_held_and_their_retry_after_shortened() -> None:
    tarpit = Tarpit(penalty_seconds=0.2, free_per_second=0.001, free_burst=3)
    began = time.monotonic()
    free = [await tarpit.refuse("hammer", 0.5) for _ in range(3)]
    assert free == [0.5, 0.5, 0.5] and time.monotonic() - began < 0.05
    held = await tarpit.refuse("hammer", 0.5)
    waited = time.monotonic() - began
    assert waited >= 0.1  # the penalty, jittered between half and one and a half times
    assert 0.2 - 0.01 <= held <= 0.4 + 0.01 and abs((0.5 - held) - waited) < 0.05  # shortened by the wait


async def test_another_key_is_answered_at_once_while_one_key_is_held() -> None:
    tarpit = Tarpit(penalty_seconds=0.3, free_per_second=0.001, free_burst=1)
    await tarpit.refuse("hammer", 1.0)
    held = asyncio.create_task(tarpit.refuse("hammer", 1.0))
    await asyncio.sleep(0)
    began = time.monotonic()
    assert await tarpit.refuse("polite", 1.0) == 1.0
    assert time.monotonic() - began < 0.05 and not held.done()
    assert await held < 1.0


async def test_the_allowance_refills_over_time() -> None:
    tarpit = Tarpit(penalty_seconds=5, free_per_second=50, free_burst=1)
    assert await tarpit.refuse("client", 1.0) == 1.0
    await asyncio.sleep(0.05)  # 2.5 refusals' worth, capped at the burst of 1
    began = time.monotonic()
    assert await tarpit.refuse("client", 1.0) == 1.0 and time.monotonic() - began < 0.05


async def test_no_more_than_max_held_answers_of_one_key_wait() -> None:
    tarpit = Tarpit(penalty_seconds=0.2, free_per_second=0.001, free_burst=0, max_held=2)
    answers = await asyncio.gather(*(tarpit.refuse("hammer", 1.0) for _ in range(4)))
    assert sorted(answers)[2:] == [1.0, 1.0] and max(sorted(answers)[:2]) < 1.0  # two held, two sent at once
