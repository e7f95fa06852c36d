"""The pool consumer's tolerance of a broker that went away: an ack through the dropped client is dropped."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from kombu.message import Message

from workers.broker_link import tolerate_lost_acks


class LostChannel:
    """A channel whose broker client was collected, as kombu's Redis channel is after a lost connection."""

    no_ack_consumers = None

    def basic_ack(self, delivery_tag: object, multiple: bool = False) -> None:
        raise AttributeError("'NoneType' object has no attribute 'hostname'")

    def basic_reject(self, delivery_tag: object, requeue: bool = False) -> None:
        raise AttributeError("'NoneType' object has no attribute 'hostname'")


def message() -> Message:
    return Message(channel=LostChannel(), delivery_tag="tag", body=b"{}", content_type="application/json",
                   content_encoding="utf-8")


def test_an_ack_on_a_lost_connection_is_logged_and_dropped_instead_of_ending_the_worker(
        caplog: pytest.LogCaptureFixture) -> None:
    tolerate_lost_acks()
    with caplog.at_level(logging.WARNING, logger="twinkle.worker"):
        message().ack_log_error(logging.getLogger("test"), (ConnectionError,))
        message().reject_log_error(logging.getLogger("test"), (ConnectionError,))
    assert "lost broker connection dropped" in caplog.text


def test_other_ack_errors_still_go_their_usual_way() -> None:
    tolerate_lost_acks()
    broken = SimpleNamespace(no_ack_consumers=None,
                             basic_ack=lambda *a, **k: (_ for _ in ()).throw(BrokenPipeError("pipe")))
    msg = Message(channel=broken, delivery_tag="tag", body=b"{}")
    with pytest.raises(BrokenPipeError):
        msg.ack_log_error(logging.getLogger("test"), (ConnectionError,))
