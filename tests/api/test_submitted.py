"""What the done messages tell of the futures this API process submitted: enough to skip a poll's read only
while the subscription has held since the submit, for the same caller, and with the result itself when the
message carried it."""

from __future__ import annotations

import pytest

from api import submitted
from api.submitted import SubmittedHere
from twinkle.futures import FutureRecord


def record(request_id: str, owner: str = "alice") -> FutureRecord:
    return FutureRecord(request_id=request_id, op="forward_backward", owner=owner, model_id="m", queue="q")


def listening() -> SubmittedHere:
    here = SubmittedHere()
    here.subscribed()
    return here


def test_a_future_submitted_here_is_known_pending_until_its_done_message_and_then_carries_its_result() -> None:
    here = listening()
    here.add(record("f1"))
    known = here.known("f1", "alice")
    assert known is not None and not known.ended
    here.ended("f1", b"result")
    assert (known.ended, known.result) == (True, b"result")


def test_nothing_is_known_for_another_caller_another_process_or_while_not_listening() -> None:
    here = listening()
    here.add(record("f1"))
    assert here.known("f1", "mallory") is None and here.known("elsewhere", "alice") is None
    quiet = SubmittedHere()  # never subscribed: a done message may be missed
    quiet.add(record("f2"))
    assert quiet.known("f2", "alice") is None


def test_a_dropped_subscription_makes_every_earlier_submit_unknown_even_once_it_returns() -> None:
    here = listening()
    here.add(record("f1"))
    here.unsubscribed()
    assert here.known("f1", "alice") is None
    here.subscribed()
    assert here.known("f1", "alice") is None  # a message sent in between may be lost
    here.add(record("f2"))
    assert here.known("f2", "alice") is not None


def test_a_done_message_read_before_the_submit_was_noted_marks_it_ended_without_a_result() -> None:
    here = listening()
    here.ended("fast", b"result")  # the op ended before the API read its submit's answer
    here.add(record("fast"))
    known = here.known("fast", "alice")
    assert known is not None and known.ended and known.result is None  # so the poll reads it


def test_the_oldest_futures_and_unknown_endings_are_forgotten_beyond_their_limits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(submitted, "LIMIT", 2)
    monkeypatch.setattr(submitted, "ENDED_LIMIT", 2)
    here = listening()
    for rid in ("f1", "f2", "f3"):
        here.add(record(rid))
    assert [here.known(rid, "alice") is not None for rid in ("f1", "f2", "f3")] == [False, True, True]
    for rid in ("e1", "e2", "e3"):
        here.ended(rid, None)
    here.add(record("e1"))
    known = here.known("e1", "alice")
    assert known is not None and not known.ended  # its ending was forgotten: only the re-read would find it
    here.forget("f2")
    assert here.known("f2", "alice") is None
