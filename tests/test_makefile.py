"""The Makefile's two documented jobs install what they need: `make demo` only what the demo runs, `make test`
the development extras too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned_installs(target: str, venv: Path) -> list[str]:
    """The pip install lines `make TARGET` would run for a fresh virtualenv."""
    done = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO, capture_output=True, text=True,
                          timeout=30, check=True)
    return [line for line in done.stdout.splitlines() if "pip install" in line and " -e " in line]


def test_make_demo_installs_the_server_and_client_extras_only_and_shows_pips_progress(tmp_path: Path) -> None:
    (line,) = planned_installs("demo", tmp_path / "venv")

    assert '".[server,client]"' in line
    assert " -q" not in line


def test_make_test_installs_the_development_extras(tmp_path: Path) -> None:
    (line,) = planned_installs("test", tmp_path / "venv")

    assert "dev" in line.split(".[", 1)[1]


def test_make_test_with_skip_browser_installs_no_chromium_and_deselects_the_browser_tests(tmp_path: Path) -> None:
    done = subprocess.run(["make", "-n", "test", f"VENV={tmp_path / 'venv'}", "SKIP_BROWSER=1"], cwd=REPO,
                          capture_output=True, text=True, timeout=30, check=True)
    assert "apt-get" not in done.stdout
    assert '-m "not browser"' in done.stdout.splitlines()[-1]
