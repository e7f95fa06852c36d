"""The pool worker's Celery consumer: survives the broker going away, and reconnects within a second.

- Celery's consumer retries a lost broker connection after 2, 4, 6 ... 30 s (kombu's defaults), so a 3 s Redis
  outage kept a pool idle for up to 9 s after Redis was back. Retrying every fraction of a second costs one
  refused connect each time and brings the pool back as soon as Redis answers.
- After a lost connection Celery closes it, and kombu's channel close tries to put its unacked messages
  back through a client that `collect()` already dropped: `AttributeError: 'NoneType' object has no
  attribute 'hostname'`, which Celery treats as unrecoverable, so the worker exited and every adapter it
  held was lost. That cleanup is best effort (the broker is gone anyway; workers/orphans.py puts such
  messages back once it returns), so its failure is logged and the consumer reconnects.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer

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
