"""What the kernel says about a process: its group, its session and when it started (Linux /proc).

A pid alone names a process only while it runs; once it exits the number is handed out again. The start time
(clock ticks after boot, field 22 of /proc/<pid>/stat) does not change while the process lives, so a pid and its
start time together name one process for good. Elsewhere than Linux every answer is None or empty, and what
depends on it (clearing a dead launcher's leftovers) does nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    group: int  #: process group id
    session: int  #: session id
    started: int  #: start time in clock ticks after boot


def read(pid: int) -> ProcessInfo | None:
    """The process `pid`, or None when none runs (a zombie counts as gone: it holds nothing but its pid)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces and parentheses
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return ProcessInfo(pid=pid, ppid=int(fields[1]), group=int(fields[2]), session=int(fields[3]),
                       started=int(fields[19]))


def started(pid: int) -> int | None:
    """The start time of `pid`, None when it does not run."""
    info = read(pid)
    return info.started if info is not None else None


def runs(pid: int, started_at: int) -> bool:
    """Whether the very process recorded as (`pid`, `started_at`) still runs."""
    return started_at > 0 and started(pid) == started_at


def everyone() -> list[ProcessInfo]:
    """Every process this user may see."""
    found = []
    try:
        entries = list(PROC.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name.isdigit() and (info := read(int(entry.name))) is not None:
            found.append(info)
    return found


def members(leader: int) -> list[ProcessInfo]:
    """The processes of the group or session that `leader` started (even after the leader itself exited)."""
    return [info for info in everyone() if leader in (info.group, info.session)]


def command_line(pid: int) -> list[str]:
    """The arguments `pid` was started with (empty when it does not run or may not be read)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def descendants(roots: set[int], table: list[ProcessInfo]) -> set[int]:
    """`roots` and every process they started, and those started, as the parent pids in `table` link them."""
    children: dict[int, list[int]] = {}
    for info in table:
        children.setdefault(info.ppid, []).append(info.pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def node() -> str:
    """What makes a pid mean one process: this boot of this machine and this pid namespace ('' off Linux). Two
    machines sharing a state dir (a home directory on a network mount) see each other's records; a pid from
    another node names nothing here."""
    try:
        boot = (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
        return f"{boot}/{os.readlink(PROC / 'self' / 'ns' / 'pid')}"
    except OSError:
        return ""
