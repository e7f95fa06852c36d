"""A pool worker's liveness file: how a process outside the worker tells a frozen worker from a busy one.

The worker rewrites the file every second from a thread of its own, naming the op in its handler and when
it started. A worker stopped by a signal, or wedged in native code that holds the interpreter, stops
rewriting it; an op stuck past its execution_timeout keeps its start time. The launcher reads the file (no
broker involved, so an outage of Redis never looks like a hang) and replaces such a worker.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "TWINKLE_LIVENESS_FILE"  # where the launcher asks a pool worker to write it
INTERVAL_SECONDS = 1.0


@dataclass(frozen=True)
class Liveness:
    pid: int
    t: float  #: wall-clock time of this write
    current: str = ""  #: request id of the op in its handler ("" = idle)
    op: str = ""
    started: float = 0.0  #: wall-clock time that op started
    execution_timeout: float = 0.0  #: the pool's limit (0 = none)


def write(path: str | Path, beat: Liveness) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".partial")
    tmp.write_text(json.dumps(asdict(beat)))
    os.replace(tmp, target)  # a reader never sees half a file


def read(path: str | Path) -> Liveness | None:
    try:
        return Liveness(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None
