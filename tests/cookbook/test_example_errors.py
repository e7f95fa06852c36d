"""What a cookbook example prints when it cannot work: no server at the address, a wrong model name, a wrong
API key. One line that says what is wrong, exit status 1, and no traceback, for either client library."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
GOOD_KEY = "tml-cookbook-good"


def run_example(path: str, base_url: str, *args: str, key: str = GOOD_KEY) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("TWINKLE_", "TINKER_"))}
    env["TWINKLE_SERVER_URL"] = base_url
    env["TWINKLE_SERVER_TOKEN"] = key
    return subprocess.run([sys.executable, f"cookbook/client/{path}", "--max-steps", "1", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)


def assert_one_line(done: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output, output
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    for text in expected:
        assert text in line, line


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A mock server that accepts GOOD_KEY only, on its own embedded broker."""
    tmp = tmp_path_factory.mktemp("keyed-server")
    port = free_port()
    config = tmp / "server.yaml"
    config.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": port},
        "storage": {"checkpoint_dir": str(tmp / "checkpoints")},
        "auth": {"api_keys": [hashlib.sha256(GOOD_KEY.encode()).hexdigest()]},
        "applications": [
            {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}},
            {"name": "models-tiny", "route_prefix": "/api/v1/model/tiny-qwen", "import_path": "model",
             "args": {"backend": "mock", "model_id": str(tiny_model_dir)}},
            {"name": "processor", "route_prefix": "/api/v1/processor", "import_path": "processor",
             "args": {"ncpu_proc_per_node": 1}},
        ],
    }))
    log = tmp / "server.log"
    env = {**os.environ, "TWINKLE_STATE_DIR": str(tmp / "state")}
    env.pop("TWINKLE_BROKER_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "twinkle.server", "launch", "-c", str(config)], cwd=REPO, env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while "[twinkle] ready" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.time() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("path", ["tinker/self_host/lora.py", "twinkle/self_host/self_cognition.py"])
def test_an_example_without_a_server_says_so_in_one_line_at_once(path: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()

    done = run_example(path, url)

    assert_one_line(done, f"no Twinkle server at {url}", "run.sh server_config_e2e.yaml")
    assert time.monotonic() - started < 30, "it retried instead of saying so"


def test_a_tinker_example_with_a_wrong_model_name_prints_the_servers_message(keyed_server: str) -> None:
    done = run_example("tinker/self_host/lora.py", keyed_server, "--base-model", "tiny-nope")

    assert_one_line(done, "error: the server answered 400", "'tiny-nope' is not served here", "tiny-qwen")


def test_a_tinker_example_with_a_wrong_key_prints_the_servers_message(keyed_server: str) -> None:
    done = run_example("tinker/self_host/lora.py", keyed_server, key="tml-wrong")

    assert_one_line(done, "error: the server answered 401", "The API key is not valid")


def test_a_twinkle_client_example_with_a_wrong_key_prints_the_servers_message(keyed_server: str) -> None:
    done = run_example("twinkle/self_host/self_cognition.py", keyed_server, key="tml-wrong")

    assert_one_line(done, "error: ", "API key is not valid")
