"""The pool worker's Celery consumer: survives the broker going away, and reconnects within a second.

- Celery's consumer retries a lost broker connection after 2, 4, 6 ... 30 s (kombu's defaults), so a 3 s Redis
  outage kept a pool idle for up to 9 s after Redis was back. Retrying every fraction of a second costs one
  refused connect each time and brings the pool back as soon as Redis answers.
- After a lost connection Celery closes it, and kombu's channel close tries to put its unacked messages
  back through a client that `collect()` already dropped: `AttributeError: 'NoneType' object has no
  attribute 'hostname'`, which Celery treats as unrecoverable, so the worker exited and every adapter it
  held was lost. That cleanup is best effort (the broker is gone anyway; workers/orphans.py puts such
  messages back once it returns), so its failure is logged and the consumer reconnects.
- An op that finishes while the broker is away acks its message through that same dropped client, with the
  same AttributeError, and Celery's event loop treats it as unrecoverable too (a pool holding many ops has
  many such acks in flight during an outage). The ack cannot reach a broker that is gone: the message stays
  unacked, workers/orphans.py puts it back once the broker returns, and its redelivery finds the future
  already terminal and is acked then. So such an ack failure is logged and dropped (`tolerate_lost_acks`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer
from kombu.message import Message

log = logging.getLogger("twinkle.worker")
RETRY_START_SECONDS = 0.2
RETRY_STEP_SECONDS = 0.2
RETRY_MAX_SECONDS = 1.0


class QuickReconnectConsumer(Consumer):  # type: ignore[misc]
    def ensure_connected(self, conn: Any) -> Any:
        ensure = conn.ensure_connection

        def quickly(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("interval_start", RETRY_START_SECONDS)
            kwargs.setdefault("interval_step", RETRY_STEP_SECONDS)
            kwargs.setdefault("interval_max", RETRY_MAX_SECONDS)
            return ensure(*args, **kwargs)

        conn.ensure_connection = quickly
        return super().ensure_connected(conn)

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        try:
            super().on_connection_error_after_connected(exc)
        except AttributeError as cleanup:
            log.warning("closing the lost broker connection failed (%s); reconnecting anyway", cleanup)


def tolerate_lost_acks() -> None:
    """Make an ack or reject whose channel lost its broker client a logged no-op instead of an unrecoverable
    error of the worker's event loop (see the module docstring). Installed once per pool process."""
    if getattr(Message, "_twinkle_tolerant", False):
        return
    ack_log_error, reject_log_error = Message.ack_log_error, Message.reject_log_error

    def ack(self: Message, logger: Any, errors: Any, multiple: bool = False) -> None:
        try:
            ack_log_error(self, logger, errors, multiple=multiple)
        except AttributeError as lost:
            log.warning("ack of a message on a lost broker connection dropped (%s); it is redelivered and "
                        "ignored once the broker is back", lost)

    def reject(self: Message, logger: Any, errors: Any, requeue: bool = False) -> None:
        try:
            reject_log_error(self, logger, errors, requeue=requeue)
        except AttributeError as lost:
            log.warning("reject of a message on a lost broker connection dropped (%s)", lost)

    Message.ack_log_error = ack  # type: ignore[method-assign]
    Message.reject_log_error = reject  # type: ignore[method-assign]
    Message._twinkle_tolerant = True  # type: ignore[attr-defined]
