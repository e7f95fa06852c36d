"""The Ray processes of one cluster on this machine, and stopping them alone (`twinkle-server stop-ray`).

`ray stop` stops every Ray process of the user on the machine, whichever cluster it belongs to (Ray 2.60 has no
option to pick one). A cluster is known by its GCS port: its `gcs_server` runs with `--gcs_server_port=PORT`,
and the raylet, dashboard, monitor and log monitor of every node that joined it with `--gcs-address=HOST:PORT`.
Ray's agents and its worker and actor processes are the raylet's children, so the cluster's processes here are
those and everything they started. A pool worker that joined the cluster as a driver is none of them: stop
Twinkle's launchers first, then Ray.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass

from twinkle.server import process_table


@dataclass(frozen=True)
class StopResult:
    stopped: list[str]  #: the short names of the processes that ended (gcs_server, raylet, ray::RankActor ...)
    killed: int  #: how many of them needed SIGKILL after the grace period
    refused: list[int]  #: processes this user may not signal


def gcs_port(address: str) -> int:
    """The port of `HOST:PORT` (or `ray://HOST:PORT`); ValueError for anything else."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return int(port)


def belongs(arguments: list[str], port: int) -> bool:
    """Whether a process started with `arguments` is a GCS, or a node process that joined the GCS, at `port`."""
    for i, arg in enumerate(arguments):
        if arg == f"--gcs_server_port={port}":
            return True
        value = arguments[i + 1] if arg in ("--gcs-address", "--gcs_address") and i + 1 < len(arguments) else ""
        if arg.startswith(("--gcs-address=", "--gcs_address=")):
            value = arg.split("=", 1)[1]
        if value.rpartition(":")[2] == str(port):
            return True
    return False


def of_cluster(port: int) -> list[int]:
    """The pids of the cluster's processes on this machine (never this process or its ancestors)."""
    return sorted(_processes(port)[1])


def _processes(port: int) -> tuple[set[int], set[int]]:
    """The cluster's main processes here (those whose command line names its GCS port), and all of its processes."""
    table = process_table.everyone()
    ours = _ancestors(os.getpid(), table)
    roots = {info.pid for info in table if belongs(process_table.command_line(info.pid), port)} - ours
    return roots, process_table.descendants(roots, table) - ours


def stop(port: int, grace: float = 10.0) -> StopResult:
    """Stop the cluster's processes here in Ray's order: SIGTERM the raylet (it stops its workers and agents), then
    the rest; once the GCS ended, or after `grace` seconds in all, SIGKILL whatever still runs (helpers such as the
    autoscaler monitor or multiprocessing's resource tracker ignore SIGTERM and would wait forever)."""
    roots, every = _processes(port)
    pids = sorted(every)
    names = {pid: _short_name(pid) for pid in pids}
    deadline = time.time() + grace
    refused: list[int] = []
    for core in ("raylet", "gcs_server"):
        first = [pid for pid in pids if pid in roots and names[pid] == core]
        for pid in pids if core == "gcs_server" else first:  # after the raylet: everything left
            if process_table.read(pid) is not None and not _signal(pid, signal.SIGTERM):
                refused.append(pid)
        _wait_gone([pid for pid in first if pid not in refused], deadline)
    time.sleep(0.2)  # a moment for what the GCS leaves to follow it
    killed = [pid for pid in pids if pid not in refused and process_table.read(pid) is not None]
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    stopped = [names[pid] for pid in pids if pid not in refused]
    return StopResult(stopped=stopped, killed=len(killed), refused=refused)


def _wait_gone(pids: list[int], deadline: float) -> None:
    while pids and time.time() < deadline:
        time.sleep(0.1)
        pids = [pid for pid in pids if process_table.read(pid) is not None]


def summary(names: list[str]) -> str:
    """'gcs_server, raylet, 2 x ray::RankActor' from the names of stopped processes."""
    return ", ".join(name if count == 1 else f"{count} x {name}" for name, count in sorted(Counter(names).items()))


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return True  # already gone
    except PermissionError:
        return False
    return True


def _short_name(pid: int) -> str:
    arguments = process_table.command_line(pid)
    if not arguments:
        return str(pid)
    first = arguments[0]
    if first.startswith("ray") and (" " in first or "::" in first):  # a title Ray gave it: ray::RankActor ...
        return first.split()[0]
    script = next((arg for arg in arguments[1:3] if arg.endswith(".py")), first)
    return os.path.basename(script)


def _ancestors(pid: int, table: list[process_table.ProcessInfo]) -> set[int]:
    parents = {info.pid: info.ppid for info in table}
    found = set()
    while pid and pid not in found:
        found.add(pid)
        pid = parents.get(pid, 0)
    return found
