"""Clearing what a launcher left running when it ended without stopping its children.

Each child of the launcher leads a session of its own (so a Ctrl-C in the terminal reaches the launcher alone,
which stops the children in order). Its own children stay in that session: a private Ray's GCS, raylet and
agents in its process group, Ray's actor processes in groups of their own within the session. Clearing a child
therefore kills every process of its session and group, once it is sure the recorded pid is still that child:
a pid handed out again to another process has another start time, and a session or group whose leader exited
keeps its id for as long as a member lives, so its members are still the child's.
"""

from __future__ import annotations

import os
import signal
import time

from twinkle.errors import LaunchAlreadyRuns
from twinkle.server import launch_record, process_table
from twinkle.server.launch_record import ChildRecord, LaunchRecord


def kill_session(pid: int, started: int) -> list[int]:
    """SIGKILL the session and group that the process (`pid`, `started`) leads, leader included, even when the
    leader is gone; the pids killed. Nothing when `pid` now names another process."""
    leader = process_table.read(pid)
    if leader is not None and leader.started != started:
        return []  # the pid was handed out again, so nothing of the old session is left
    killed: list[int] = []
    for _ in range(5):  # a member may start another process while we kill: sweep until none is left
        members = [info for info in process_table.members(pid) if info.pid != os.getpid()]
        if not members:
            break
        for info in members:
            try:
                os.kill(info.pid, signal.SIGKILL)
                killed.append(info.pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    return sorted(set(killed))


def clear(record: LaunchRecord, reaped_within: float = 3.0) -> list[str]:
    """Kill what the dead launcher of `record` left; one line per child that still had processes. Returns once the
    killed processes are gone from the process table (or after `reaped_within` seconds), so that what starts next
    finds their pids free: a pool lease held by a pid that still exists is not taken over."""
    lines, pending = [], []
    for child in record.children:
        killed = kill_session(child.pid, child.started)
        if killed:
            lines.append(_cleared(child, killed, record))
            pending += killed
    deadline = time.time() + reaped_within
    while pending and time.time() < deadline:
        pending = [pid for pid in pending if _exists(pid)]
        time.sleep(0.02)
    return lines


def _exists(pid: int) -> bool:
    """Whether `pid` is still in the process table, a zombie its parent has not reaped yet included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _cleared(child: ChildRecord, killed: list[int], record: LaunchRecord) -> str:
    started = len([pid for pid in killed if pid != child.pid])
    processes = f"{started} process{'es' if started != 1 else ''}"
    if child.pid not in killed:
        what = f"{processes} that {child.name} (PID {child.pid}) started"
    else:
        what = f"{child.name} (PID {child.pid})" + (f" and {processes} it started" if started else "")
    return f"cleared what launcher PID {record.pid} left running: {what}"


def overlaps(record: LaunchRecord, mine: LaunchRecord) -> bool:
    """Whether `record` ran something this launch runs: the same record, the same API port, or a queue on the same
    broker (a second consumer of a queue takes messages the first one holds)."""
    if record.name == mine.name:
        return True
    if record.port and record.port == mine.port:
        return True
    return record.broker_url == mine.broker_url and bool(record.queues() & mine.queues())


def clear_predecessors(mine: LaunchRecord) -> list[str]:
    """Before `mine` starts anything: kill the leftovers of dead launches that overlap it and drop their records
    (records of dead launches with nothing left go too); one line per cleared child. Raises LaunchAlreadyRuns
    when a running launch on this machine runs the same pool replicas."""
    lines: list[str] = []
    for path, record in launch_record.every():
        if record.pid == mine.pid or not record.here():
            continue
        if record.launcher_runs():
            same_workers = record.name == mine.name and not mine.port  # the same API port: the port check says it
            if same_workers or (record.broker_url == mine.broker_url and record.queues() & mine.queues()):
                shared = ", ".join(sorted(record.queues() & mine.queues())) or record.name
                raise LaunchAlreadyRuns(
                    f"launcher PID {record.pid} ({record.config}) already runs {shared} on this machine.",
                    hint=f"stop it first (kill {record.pid}), or start other replicas with --replica")
            continue
        if overlaps(record, mine):
            lines.extend(clear(record))
            launch_record.remove(path)
        elif not any(process_table.runs(child.pid, child.started) for child in record.children):
            launch_record.remove(path)  # nothing left of it: a stale file
    return lines
