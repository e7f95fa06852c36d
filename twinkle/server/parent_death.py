"""Children that die with the process that started them, however it ends (SIGKILL and the OOM killer included).

Linux sends a child its parent-death signal (prctl PR_SET_PDEATHSIG) when the *thread* that forked it exits, so
children must be started from a thread that lives as long as the process: the launcher starts every child from
its main thread, and `preexec` refuses any other. The signal is set in the child between fork and exec; a parent
that died before that moment is caught by comparing the child's parent pid with the one that forked it.
Elsewhere than Linux `preexec` does nothing (the launcher's reaper and its successor still clear leftovers).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
ORPHANED_EXIT = 111  # the child found its parent gone before it could run: it exits before exec


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return function  # type: ignore[no-any-return]


_PRCTL = _prctl()  # looked up in the parent: between fork and exec the child only calls it


def supported() -> bool:
    return _PRCTL is not None


def preexec(death_signal: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A Popen `preexec_fn` that gives the child `death_signal` when this process dies (None where unsupported)."""
    if _PRCTL is None:
        return None
    if threading.current_thread() is not threading.main_thread():
        # the signal would fire when this thread ends, killing a healthy child
        raise RuntimeError("children that die with their parent must be started from the main thread")
    prctl, parent = _PRCTL, os.getpid()

    def set_death_signal() -> None:
        if prctl(PR_SET_PDEATHSIG, death_signal, 0, 0, 0) != 0:
            os._exit(ORPHANED_EXIT)  # no way to tie it to its parent: never run untied
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(ORPHANED_EXIT)

    return set_death_signal
