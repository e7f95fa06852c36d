"""When is a launched child ready? The API when its health check answers from this launch; a pool when its own
process (not an earlier one, nor another server's) sends a heartbeat.

The API answers /healthz with the instance id the launcher gave it ($TWINKLE_INSTANCE_ID), so a health check
that reaches some other server listening on the same port never counts as ours.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import redis

from twinkle.keys import Keys

if TYPE_CHECKING:
    from twinkle.config.server_config import ServerConfig


class Probed(Protocol):
    name: str
    queue: str | None
    attempts: Any  # StartAttempts | None

    def alive(self) -> bool: ...

    def pid(self) -> int | None: ...


def new_instance_id() -> str:
    return secrets.token_hex(8)


class Readiness:
    def __init__(self, config: ServerConfig, r: redis.Redis, keys: Keys, instance: str) -> None:
        host = config.http_options.host
        local = "127.0.0.1" if host in ("0.0.0.0", "", None) else "::1" if host == "::" else host
        server = config.server_app()
        prefix = (server.route_prefix if server else "/api/v1").rstrip("/")
        netloc = f"[{local}]" if ":" in local else local
        self.health_url = f"http://{netloc}:{config.http_options.port}{prefix}/healthz"
        self.listening = f"http://{host}:{config.http_options.port}"
        self.r = r
        self.keys = keys
        self.instance = instance

    def poll(self, children: Sequence[Probed]) -> list[str]:
        """Mark the children that became ready since the last poll; one line for each of them."""
        lines = []
        for child in children:
            attempts = child.attempts
            if attempts is None or attempts.ready or not child.alive():
                continue
            if child.queue is None and self._api_answers():
                attempts.became_ready()
                lines.append(f"API listening on {self.listening}")
            elif child.queue is not None and self._beats(child.queue, child.pid()):
                attempts.became_ready()
                lines.append(f"pool {child.queue} ready (pid {child.pid()})")
        return lines

    def _api_answers(self) -> bool:
        import httpx

        try:
            reply = httpx.get(self.health_url, timeout=1)
            return reply.status_code == 200 and reply.json().get("instance") == self.instance
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    def _beats(self, queue: str, pid: int | None) -> bool:
        try:
            raw = self.r.get(self.keys.pool_heartbeat(queue))
        except redis.RedisError:
            return False
        if not raw:
            return False
        try:
            return bool(json.loads(raw).get("pid") == pid)
        except (ValueError, AttributeError):
            return False
