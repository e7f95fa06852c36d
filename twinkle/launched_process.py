"""What a process `twinkle-server launch` starts (the API, a pool worker) shares with its launcher: the environment
variables the launcher sets for it, and the child's side of each.

The launcher's side (which children get which variables, start-up retries, readiness) lives in twinkle/server;
the launched processes import only this module, never the launcher package.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

LEVEL_ENV = "TWINKLE_LOG_LEVEL"
VERBOSE_ENV = "TWINKLE_VERBOSE"  # "1" under `launch -v`
DEV_MODE_SAID_ENV = "TWINKLE_DEV_MODE_SAID"  # the launcher warned of development mode: its API need not again
INSTANCE_ENV = "TWINKLE_INSTANCE_ID"  # one id per launch, which /healthz answers (twinkle/server/readiness.py)
START_FAILURE_ENV = "TWINKLE_START_FAILURE_FILE"  # where a child that cannot start leaves its one-line cause


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_library_warnings() -> None:
    """In a child of a non-verbose launch: drop the warnings a user cannot act on."""
    if verbose():
        return
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    # Celery's notice for containers that run as root (they usually do)
    warnings.filterwarnings("ignore", message=".*superuser privileges.*")


def started_by_launcher() -> bool:
    """Whether the launcher waits for this process's start-up cause (it then prints it, once, itself)."""
    return bool(os.environ.get(START_FAILURE_ENV))


def write_cause(error: BaseException) -> str:
    """The one-line cause of a failed start, also written to the launcher's cause file when there is one."""
    text = " ".join(str(error).split()).rstrip(".") or type(error).__name__
    hint = getattr(error, "hint", None)
    line = f"{text} ({hint})" if hint and hint not in text else text
    path = os.environ.get(START_FAILURE_ENV)
    if path:
        try:
            Path(path).write_text(line, encoding="utf-8")
        except OSError:
            pass  # the launcher then reports the exit code alone
    return line
