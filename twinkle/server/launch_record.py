"""What a running `launch` leaves for other commands on the same machine: where its embedded broker listens.

The embedded Valkey gets a free port at every launch, so `twinkle-server clear persistence -c cfg.yaml` cannot
derive it from the config. The launcher writes `<state dir>/launch-<API port>.json` once its broker runs and
removes it at stop; the API port names the launch because no two servers on one machine share it. The state
dir is $TWINKLE_STATE_DIR, else $XDG_STATE_HOME/twinkle, else ~/.local/state/twinkle.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_DIR_ENV = "TWINKLE_STATE_DIR"


@dataclass(frozen=True)
class LaunchRecord:
    pid: int  #: the launcher's process
    port: int  #: the API's port
    broker_url: str
    config: str  #: the config file it runs, resolved


def state_dir() -> Path:
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "twinkle"


def record_path(port: int) -> Path:
    return state_dir() / f"launch-{port}.json"


def write(record: LaunchRecord) -> Path | None:
    """Write the record (readable by this user only: the URL reaches the broker); None when it cannot be written,
    which costs nothing but the convenience of finding this launch."""
    path = record_path(record.port)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(asdict(record)), encoding="utf-8")
        tmp.chmod(0o600)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def remove(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def find(port: int) -> LaunchRecord | None:
    """The launch serving `port` on this machine, if one runs (a record left by a killed launcher is ignored)."""
    try:
        record = LaunchRecord(**json.loads(record_path(port).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return record
