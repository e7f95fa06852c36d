"""`python -m twinkle.demo --backend mock`: prints the port it serves on, keeps its server log after it exits, and
does what the README says the mock demo does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_the_mock_demo_prints_its_port_keeps_its_log_and_its_loss_falls_to_about_half(tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("TWINKLE_")}
    done = subprocess.run([sys.executable, "-m", "twinkle.demo", "--backend", "mock", "--workdir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"server ready on http://127\.0\.0\.1:\d+ in ", done.stdout), done.stdout
    log = tmp_path / "server.log"
    assert f"its log stays in {log}" in done.stdout
    assert "[twinkle] ready" in log.read_text()
    losses = [float(value) for value in re.findall(r"loss per token (\d+\.\d+)", done.stdout)]
    # the README: "its loss falls from about 7 to about 0.5"
    assert len(losses) == 30 and losses[0] > 6.5 and losses[-1] < 0.6, losses
