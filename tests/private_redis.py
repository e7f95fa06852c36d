"""A redis-server of a test's own, on a free port, that the test may stop, freeze and start again.

Fault-injection tests use it instead of the shared Redis at 6379, which other test runs rely on.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.harness import free_port


class PrivateRedis:
    def __init__(self, directory: Path, *, appendonly: bool = False) -> None:
        self.port = free_port()
        self.directory = directory
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
             "--dir", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while not self.answers():
            if time.time() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.2).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """Stop it as a crash would (SIGKILL): with appendonly, what was fsynced survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def outage(self, seconds: float) -> None:
        """Kill it, stay down for `seconds`, start it again on the same port."""
        self.kill()
        time.sleep(seconds)
        self.start()
