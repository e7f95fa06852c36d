"""The Makefile's two documented jobs install what they need: `make demo` only what the demo runs, `make test`
the development extras too."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(*args: str) -> str:
    """What `make -n ARGS` prints, as a top-level make would print it: under `make test` (CI) the inherited
    MAKELEVEL would add 'Entering/Leaving directory' lines."""
    env = {k: v for k, v in os.environ.items() if k not in {"MAKELEVEL", "MAKEFLAGS", "MFLAGS"}}
    return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=True,
                          env=env).stdout


def planned_installs(target: str, venv: Path) -> list[str]:
    """The pip install lines `make TARGET` would run for a fresh virtualenv."""
    done = dry_run(target, f"VENV={venv}")
    return [line for line in done.splitlines() if "pip install" in line and " -e " in line]


def test_make_demo_installs_the_server_and_client_extras_only_and_shows_pips_progress(tmp_path: Path) -> None:
    (line,) = planned_installs("demo", tmp_path / "venv")

    assert '".[server,client]"' in line
    assert " -q" not in line


def test_make_test_installs_the_development_extras(tmp_path: Path) -> None:
    (line,) = planned_installs("test", tmp_path / "venv")

    assert "dev" in line.split(".[", 1)[1]


def test_make_test_with_skip_browser_installs_no_chromium_and_deselects_the_browser_tests(tmp_path: Path) -> None:
    done = dry_run("test", f"VENV={tmp_path / 'venv'}", "SKIP_BROWSER=1")
    assert "apt-get" not in done
    assert '-m "not browser"' in done.splitlines()[-1]
