"""Raise this process's open-file limit to its hard limit: one API process holds thousands of long-polls,
each an open socket, and the common soft limit of 1,024 would refuse connections past it."""

from __future__ import annotations

import resource


def raise_open_files_limit() -> int:
    """The soft limit after raising it as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft
