"""Session: the server-side record that keeps this client's models alive while its heartbeat runs.

A session that stays silent longer than the server's adapter timeout loses its models, so a daemon
thread sends a heartbeat every `heartbeat_interval` seconds until `close()`.
"""

from __future__ import annotations

import logging
import threading

from twinkle import __version__
from twinkle_client.errors import InvalidArgument, NotFoundError, TwinkleClientError
from twinkle_client.transport import NO_RETRIES, Transport

log = logging.getLogger("twinkle_client")

HEARTBEAT_TIMEOUT = 10.0


class Session:
    """Creates a session on the server and keeps it alive until `close()`."""

    def __init__(
        self,
        transport: Transport,
        *,
        heartbeat_interval: float = 10.0,
        tags: list[str] | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> None:
        if heartbeat_interval <= 0:
            raise InvalidArgument(f"heartbeat_interval must be positive, got {heartbeat_interval}.")
        self._transport = transport
        self.heartbeat_interval = heartbeat_interval
        reply = transport.request(
            "POST",
            "/create_session",
            json={
                "tags": tags or ["twinkle_client"],
                "user_metadata": user_metadata or {},
                "sdk_version": f"twinkle_client/{__version__}",
            },
        )
        self.session_id: str = reply["session_id"]
        self.heartbeats_sent = 0
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=self._beat, name=f"twinkle-heartbeat-{self.session_id[-8:]}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the heartbeat thread is running."""
        return self._thread.is_alive()

    def close(self, reason: str = "success") -> None:
        """Stop the heartbeat and tell the server the session is finished (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_TIMEOUT + 1)
        try:
            self._transport.request(
                "POST",
                f"/sessions/{self.session_id}/finish",
                json={"reason": {"type": reason}},
                idempotent=True,
                timeout=HEARTBEAT_TIMEOUT,
                retry=NO_RETRIES,
            )
        except TwinkleClientError as error:
            # The server reaps silent sessions anyway; a failed goodbye must not fail the caller's exit.
            log.debug("Finishing session %s failed: %s", self.session_id, error)

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.heartbeat_interval):
            try:
                # No retries: the next beat is the retry, and close() must not wait behind a backoff.
                self._transport.request(
                    "POST",
                    "/session_heartbeat",
                    json={"session_id": self.session_id},
                    idempotent=True,
                    timeout=HEARTBEAT_TIMEOUT,
                    retry=NO_RETRIES,
                )
                self.heartbeats_sent += 1
                if failing:
                    log.info("Heartbeats for session %s reach the server again.", self.session_id)
                failing = False
            except NotFoundError:
                log.warning(
                    "The server no longer knows session %s (silent for too long?); its models may be "
                    "unloaded. "
                    "Create a new client with init_twinkle_client().",
                    self.session_id,
                )
                return
            except TwinkleClientError as error:
                if self._stop.is_set():
                    return
                if not failing:
                    log.warning(
                        "Heartbeat for session %s failed: %s. Retrying every %.0f s.",
                        self.session_id,
                        error,
                        self.heartbeat_interval,
                    )
                failing = True
