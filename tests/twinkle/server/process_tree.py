"""Real process trees shaped like a launcher's child: a session leader with one child in its process group (as a
private Ray's GCS and raylet are) and one in a group of its own within the session (as Ray's actors are)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from twinkle.server import process_table

REPO = Path(__file__).resolve().parents[3]

# run by the session leader: start the two grandchildren, say their pids, then wait
LEADER = """
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
same_group = subprocess.Popen(sleeper)
own_group = subprocess.Popen(sleeper, process_group=0)
print(same_group.pid, own_group.pid, flush=True)
time.sleep(600)
"""


@dataclass
class Tree:
    leader: subprocess.Popen[str]
    grandchildren: list[int]
    started: dict[int, int]  # pid -> start time, so a reused pid is not taken for one of ours

    @property
    def pid(self) -> int:
        return self.leader.pid

    def running(self) -> list[int]:
        """Our processes that still run (a reaped or zombie leader counts as gone)."""
        return [pid for pid, started in self.started.items() if process_table.runs(pid, started)]

    def kill(self) -> None:
        for pid in self.running():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.leader.poll() is None:
            self.leader.wait()


def start_tree(preexec_fn: Callable[[], None] | None = None) -> Tree:
    """A session leader (its own session, as the launcher starts children) with its two grandchildren running."""
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True, preexec_fn=preexec_fn)
    assert leader.stdout is not None
    grandchildren = [int(pid) for pid in leader.stdout.readline().split()]
    pids = [leader.pid, *grandchildren]
    started = {pid: process_table.started(pid) or 0 for pid in pids}
    assert all(started.values()), started
    return Tree(leader, grandchildren, started)


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
