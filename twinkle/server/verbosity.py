"""How much `twinkle-server launch` and its children print.

By default a launch prints its own `[twinkle]` lines (where it listens, each pool's state changes, errors) and
the children log warnings and errors only: no Celery banner, no per-task `received` / `succeeded` lines, no
libraries' FutureWarnings. `launch -v` restores all of them (children log at INFO). An explicit
$TWINKLE_LOG_LEVEL still sets the children's level either way.
"""

from __future__ import annotations

import os
import warnings

LEVEL_ENV = "TWINKLE_LOG_LEVEL"
VERBOSE_ENV = "TWINKLE_VERBOSE"
DEV_MODE_SAID_ENV = "TWINKLE_DEV_MODE_SAID"  # the launcher warned of development mode: its API need not again
# libraries' notices for their own developers; builtin categories, so the interpreter resolves them at start
_QUIET_WARNINGS = "ignore::FutureWarning,ignore::DeprecationWarning,ignore::PendingDeprecationWarning"


def children_env(verbose: bool) -> dict[str, str]:
    """What the launcher puts in its children's environment."""
    env = {LEVEL_ENV: os.environ.get(LEVEL_ENV) or ("INFO" if verbose else "WARNING")}
    if verbose:
        env[VERBOSE_ENV] = "1"
    elif not os.environ.get("PYTHONWARNINGS"):
        env["PYTHONWARNINGS"] = _QUIET_WARNINGS  # from interpreter start: import-time warnings included
    return env


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
