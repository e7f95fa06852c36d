"""Start-up failures of the launcher's children: why a child died before it became ready, and when to stop trying.

A pool whose model directory is missing fails the same way on every start; restarting it forever prints a
traceback every few seconds and hides the cause. A child that dies before it was ever ready is retried
after a growing pause (a download or a busy device may clear), and after START_ATTEMPTS tries the launcher
gives up on it with the one-line cause the child left in its cause file.

The child side (twinkle/launched_process.py): a pool worker that cannot start writes its cause to the file named
by $TWINKLE_START_FAILURE_FILE and exits with PoolExit.START_FAILED (twinkle/pool_exit.py) instead of printing a
traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

START_ATTEMPTS = 3
FIRST_PAUSE_SECONDS = 1.0


@dataclass
class StartAttempts:
    """One child's tries to become ready since it was last ready."""

    cause_file: Path
    failures: int = 0
    ready: bool = False
    given_up: bool = False

    def started(self) -> None:
        self.ready = False
        self.cause_file.unlink(missing_ok=True)

    def became_ready(self) -> None:
        self.ready = True
        self.failures = 0

    def cause(self, exit_code: int | None) -> str:
        try:
            text = self.cause_file.read_text(encoding="utf-8").strip()
        except OSError:
            text = ""
        return text or f"exited with code {exit_code} before it was ready"

    def failed(self) -> float | None:
        """Count a death before ready; the pause before the next try, or None to give up."""
        self.failures += 1
        if self.failures >= START_ATTEMPTS:
            self.given_up = True
            return None
        return FIRST_PAUSE_SECONDS * 2 ** (self.failures - 1)
