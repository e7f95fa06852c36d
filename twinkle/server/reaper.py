"""The launcher's reaper: a small process that clears what the launcher leaves when it dies without stopping.

The kernel kills each child with its launcher (twinkle/server/parent_death.py), but not what the child started
(a private Ray's agents, Ray's actor processes): those live on in the child's session. The reaper holds the read
end of a pipe whose write end only the launcher holds. When the launcher ends, however it ends, the pipe closes;
the reaper then reads the launch record and kills every session it names (twinkle/server/leftovers.py), printing
one line per child it cleared, and removes the record. A launcher that stopped in order removed its record
first, so then there is nothing to do. The reaper leads a session of its own, so a signal to the launcher's
process group does not reach it.

    python -m twinkle.server.reaper LAUNCHER_PID RECORD_PATH   (stdin: the pipe)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from twinkle.server import launch_record, leftovers


def start(record_path: Path) -> subprocess.Popen[bytes]:
    """Start the reaper of this process (the launcher); closing its stdin, or dying, sets it to work."""
    return subprocess.Popen([sys.executable, "-m", "twinkle.server.reaper", str(os.getpid()), str(record_path)],
                            stdin=subprocess.PIPE, start_new_session=True)


def stop(reaper: subprocess.Popen[bytes] | None) -> None:
    """After an orderly stop (the record removed): let the reaper see the launcher go, and wait for it."""
    if reaper is None or reaper.stdin is None:
        return
    reaper.stdin.close()
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def main(argv: list[str]) -> int:
    launcher, path = int(argv[0]), Path(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):  # nothing is ever written: this returns b"" when the launcher is gone
        pass
    record = launch_record.read(path)
    if record is None or record.pid != launcher:
        return 0  # stopped in order, or a successor has taken the record over
    lines = leftovers.clear(record)
    launch_record.remove(path)
    try:
        for line in lines:
            print(f"[twinkle] {line}", flush=True)
    except OSError:  # the launcher's output went with it (a closed pipe): the clearing is what counts
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
