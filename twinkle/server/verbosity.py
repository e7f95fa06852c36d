"""How much `twinkle-server launch` and its children print.

By default a launch prints its own `[twinkle]` lines (where it listens, each pool's state changes, errors) and
the children log warnings and errors only: no Celery banner, no per-task `received` / `succeeded` lines, no
libraries' FutureWarnings. `launch -v` restores all of them (children log at INFO). An explicit
$TWINKLE_LOG_LEVEL still sets the children's level either way. This is the launcher's side; a child's is
twinkle/launched_process.py.
"""

from __future__ import annotations

import os

from twinkle.launched_process import LEVEL_ENV, VERBOSE_ENV

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
