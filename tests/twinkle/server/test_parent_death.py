"""twinkle/server/parent_death.py: a child started with its `preexec` dies when its parent is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.twinkle.server.process_tree import REPO, wait_until
from twinkle.server import parent_death, process_table

pytestmark = pytest.mark.skipif(not parent_death.supported(), reason="PR_SET_PDEATHSIG is Linux's")

# a parent that starts one child tied to it and one not, says their pids, and waits to be killed
PARENT = """
import subprocess, sys, time
from twinkle.server import parent_death
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
tied = subprocess.Popen(sleeper, start_new_session=True, preexec_fn=parent_death.preexec())
untied = subprocess.Popen(sleeper, start_new_session=True)
print(tied.pid, untied.pid, flush=True)
time.sleep(600)
"""


def test_a_child_dies_with_its_sigkilled_parent_and_one_started_without_the_signal_lives_on() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    tied, untied = (int(pid) for pid in parent.stdout.readline().split())
    started = {pid: process_table.started(pid) for pid in (tied, untied)}
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

        wait_until(lambda: not process_table.runs(tied, started[tied] or 0), 5, "the tied child to die")
        assert process_table.runs(untied, started[untied] or 0)
    finally:
        if process_table.runs(untied, started[untied] or 0):
            os.kill(untied, signal.SIGKILL)


def test_children_tied_to_their_parent_are_refused_from_any_thread_but_the_main_one() -> None:
    caught: list[BaseException] = []

    def start() -> None:
        try:
            parent_death.preexec()
        except RuntimeError as error:
            caught.append(error)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()

    assert len(caught) == 1 and "main thread" in str(caught[0])
