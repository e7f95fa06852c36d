"""The README's commands and snippets work as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import LaunchedServer
from twinkle.server.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def test_the_cli_reference_lists_every_twinkle_server_command() -> None:
    table = section("CLI reference")
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]

    missing = [name for name in commands if f"| `{name}" not in table]
    assert not missing, f"commands missing from the README's CLI table: {missing}"


def test_the_quick_start_says_what_to_run_after_launch() -> None:
    (commands,) = code_blocks(section("Quick start"), "bash")
    lines = [line for line in commands.splitlines() if line.strip()]
    launch = next(i for i, line in enumerate(lines) if "run.sh" in line or "twinkle-server launch" in line)

    assert any(line.startswith(".venv/bin/python cookbook/client/") for line in lines[launch + 1:]), commands


def test_the_models_the_readme_builds_in_the_checkout_are_ignored_by_git() -> None:
    assert "/models/" in (REPO / ".gitignore").read_text().splitlines()


def test_the_tinker_sdk_snippet_runs_as_printed(mock_server: LaunchedServer) -> None:
    (snippet,) = code_blocks(section("Using the Tinker SDK"), "python")
    assert "http://127.0.0.1:8000" in snippet
    code = snippet.replace("http://127.0.0.1:8000", mock_server.base_url)
    env = {name: value for name, value in os.environ.items() if not name.startswith(("TWINKLE_", "TINKER_"))}

    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)

    assert done.returncode == 0, done.stderr[-3000:]
    assert "grad_norm:mean" in done.stdout


def test_the_examples_and_their_no_server_hint_name_the_server_the_quick_start_launches() -> None:
    from twinkle_client.example_connection import START_HINT

    (commands,) = code_blocks(section("Quick start"), "bash")
    assert START_HINT in commands
    examples = sorted((REPO / "cookbook" / "client").glob("*/self_host/*.py"))
    runnable = [path for path in examples if "runpy" not in path.read_text()]  # a file-name alias aside
    assert runnable and all(START_HINT in path.read_text() for path in runnable), [
        path.name for path in runnable if START_HINT not in path.read_text()]


def test_the_quick_starts_second_terminal_needs_no_activated_venv() -> None:
    (commands,) = code_blocks(section("Quick start"), "bash")
    client = [line for line in commands.splitlines() if "cookbook/client/tinker" in line]
    assert client and all(line.startswith(".venv/bin/python ") for line in client)
