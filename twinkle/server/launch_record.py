"""What a running `launch` leaves for other commands on the same machine: its broker and its children.

`<state dir>/<name>.json` holds the launcher's pid and start time, the broker it uses, the config it runs and
every child it started (pid, start time, role, queue). Other commands read it:

- `twinkle-server clear persistence -c cfg.yaml` finds the embedded Valkey of a running launch (it gets a free
  port at every launch, so the config cannot say where it is);
- a launch that ended without stopping its children (SIGKILL, the OOM killer) is recognised by its successor,
  which kills what it left (twinkle/server/leftovers.py) before it starts anything;
- the launcher's reaper (twinkle/server/reaper.py) reads it when the launcher dies.

The name says what the launch runs, so that the launch that takes over finds it: `launch-<API port>` for a launch
with an API (no two servers on one machine share that port), `launch-worker-<pool>-r<replicas>-<config digest>` for
`--only worker`, `launch-flower-<port>` for `--only flower`, each followed by `@<host name>`. The state dir is
$TWINKLE_STATE_DIR, else $XDG_STATE_HOME/twinkle, else ~/.local/state/twinkle. Pids and start times are this
machine's: where nodes share the state dir (a home directory on a network mount), each record names its node and
the others leave it alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from twinkle.server import process_table

STATE_DIR_ENV = "TWINKLE_STATE_DIR"


@dataclass(frozen=True)
class ChildRecord:
    name: str  #: as the launcher prints it: "api", "worker models-tiny#0", "flower", "broker"
    pid: int  #: also its process group and session: each child leads a session of its own
    started: int  #: its start time (twinkle/server/process_table.py): a pid handed out again has another
    queue: str = ""  #: the queue a pool worker consumes


@dataclass(frozen=True)
class LaunchRecord:
    pid: int  #: the launcher's process
    port: int  #: the API's port (0: this launch runs no API)
    broker_url: str
    config: str  #: the config file it runs, resolved
    started: int = 0  #: the launcher's start time (0: unknown)
    name: str = ""  #: the file's name without .json
    children: tuple[ChildRecord, ...] = field(default=())
    node: str = ""  #: the machine boot and pid namespace its pids belong to (process_table.node(); '': this one)

    def here(self) -> bool:
        """Whether its pids are this node's (a record of another machine sharing the state dir is not)."""
        return not self.node or self.node == process_table.node()

    def launcher_runs(self) -> bool:
        """Whether the launcher that wrote this record still runs (not merely a process with its old pid); a launcher
        on another node counts as running, since nothing here can tell."""
        if not self.here():
            return True
        if self.started:
            return process_table.runs(self.pid, self.started)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, another user's
        return True

    def queues(self) -> set[str]:
        return {child.queue for child in self.children if child.queue}


def state_dir() -> Path:
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "twinkle"


def record_name(config_path: str, only: str | None, only_name: str | None, replicas: Iterable[int],
                port: int, flower_port: int) -> str:
    """The name of the record of a launch that runs these roles (see the module docstring)."""
    if only in (None, "api"):
        return _on_this_host(f"launch-{port}")
    if only == "flower":
        return _on_this_host(f"launch-flower-{flower_port}")
    digest = hashlib.sha256(config_path.encode()).hexdigest()[:8]
    pool = _safe(only_name or "")
    return _on_this_host(f"launch-worker-{pool}-r{'-'.join(str(i) for i in sorted(replicas))}-{digest}")


def _on_this_host(name: str) -> str:
    return f"{name}@{_safe(socket.gethostname())}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def record_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def write(record: LaunchRecord) -> Path | None:
    """Write the record (readable by this user only: the URL reaches the broker); None when it cannot be written,
    which costs the convenience of finding this launch and the clearing of what it might leave."""
    path = record_path(record.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps(asdict(record)), encoding="utf-8")
        tmp.chmod(0o600)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def remove(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def read(path: Path) -> LaunchRecord | None:
    """The record in `path`; None when there is none or it cannot be read (a partial or foreign file)."""
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        children = tuple(ChildRecord(**child) for child in data.pop("children", []))
        return LaunchRecord(**{"name": path.stem, **data}, children=children)
    except (OSError, ValueError, TypeError):
        return None


def every() -> list[tuple[Path, LaunchRecord]]:
    """Every record in the state dir, running launches and dead ones alike."""
    found = []
    for path in sorted(state_dir().glob("launch-*.json")):
        record = read(path)
        if record is not None:
            found.append((path, record))
    return found


def find(port: int) -> LaunchRecord | None:
    """The launch serving `port` on this machine, if one runs (a record left by a killed launcher is ignored)."""
    record = read(record_path(_on_this_host(f"launch-{port}")))
    return record if record is not None and record.here() and record.launcher_runs() else None
