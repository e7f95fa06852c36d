"""twinkle/server/reaper.py: when its launcher is SIGKILLed the reaper kills what the children started; after an
orderly stop it touches nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.twinkle.server.process_tree import REPO, wait_until
from twinkle.server import parent_death, process_table

pytestmark = pytest.mark.skipif(not parent_death.supported(), reason="Linux only")

# a launcher in miniature: one child (with its two grandchildren) tied to it, recorded, and a reaper
LAUNCHER = """
import os, subprocess, sys, time
from twinkle.server import launch_record, parent_death, process_table, reaper
from tests.twinkle.server.process_tree import LEADER
child = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=parent_death.preexec())
grandchildren = child.stdout.readline().split()
record = launch_record.LaunchRecord(
    os.getpid(), 0, "redis://x", "/cfg.yaml", process_table.started(os.getpid()), "launch-worker-m-r0-abc",
    (launch_record.ChildRecord("worker m#0", child.pid, process_table.started(child.pid), "model.m.0"),))
path = launch_record.write(record)
guard = reaper.start(path)
print(child.pid, *grandchildren, guard.pid, flush=True)
if sys.argv[1] == "orderly":
    launch_record.remove(path)
    reaper.stop(guard)
    print("stopped", flush=True)
time.sleep(600)
"""


def start_launcher(tmp_path: Path, how: str) -> tuple[subprocess.Popen[str], list[int], dict[int, int], Path]:
    env = {**os.environ, "TWINKLE_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(REPO)}
    out = tmp_path / "launcher.out"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, how], cwd=REPO, env=env, stdout=out.open("w"),
                                text=True)
    wait_until(lambda: out.read_text().strip(), 20, "the launcher to start its child and reaper")
    pids = [int(pid) for pid in out.read_text().split()[:4]]
    return launcher, pids, {pid: process_table.started(pid) or 0 for pid in pids}, out


def running(started: dict[int, int]) -> list[int]:
    return [pid for pid, at in started.items() if process_table.runs(pid, at)]


def test_a_sigkilled_launchers_reaper_kills_its_childs_whole_session_says_so_and_drops_the_record(
        tmp_path: Path) -> None:
    launcher, _, started, out = start_launcher(tmp_path, "sigkill")
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()

        wait_until(lambda: not running(started), 5, f"the child, its grandchildren and the reaper to end: "
                   f"{running(started)} still run")
        assert f"cleared what launcher PID {launcher.pid} left running: " in out.read_text()
        assert not list((tmp_path / "state").glob("*.json"))
    finally:
        for pid in running(started):
            os.kill(pid, signal.SIGKILL)


def test_after_an_orderly_stop_the_reaper_ends_and_touches_nothing(tmp_path: Path) -> None:
    launcher, (child, *grandchildren, reaper_pid), started, out = start_launcher(tmp_path, "orderly")
    try:
        wait_until(lambda: "stopped" in out.read_text(), 10, "the orderly stop")

        assert not process_table.runs(reaper_pid, started[reaper_pid])
        assert running(started) == [child, *grandchildren]
    finally:
        launcher.kill()
        launcher.wait()
        for pid in grandchildren:
            if process_table.runs(pid, started[pid]):
                os.kill(pid, signal.SIGKILL)
