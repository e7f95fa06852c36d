"""`twinkle-server launch` as a newcomer meets it: a busy port, a pool that cannot start, quiet output, and
`clear persistence` against the embedded broker of a running default-config server.

Every server here runs on its own embedded broker (no broker.url), as the README's Quick start runs it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.harness import free_port, stop_process_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[3]


def config(tmp: Path, model_dir: Path, port: int) -> Path:
    path = tmp / "server.yaml"
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": port},
        "storage": {"checkpoint_dir": str(tmp / "checkpoints")},
        "applications": [
            {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}},
            {"name": "models-tiny", "route_prefix": "/api/v1/model/tiny-qwen", "import_path": "model",
             "args": {"backend": "mock", "model_id": str(model_dir)}},
        ],
    }))
    return path


class Launch:
    """One `python -m twinkle.server launch` with its output in a file."""

    def __init__(self, tmp: Path, config_path: Path, *args: str) -> None:
        self.log_path = tmp / f"launch-{time.monotonic_ns()}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TWINKLE_STATE_DIR": str(tmp / "state")}
        env.pop("TWINKLE_LOG_LEVEL", None)  # the defaults a user gets
        env.pop("TWINKLE_BROKER_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "twinkle.server", "launch", "-c", str(config_path), *args],
            cwd=REPO, env=env, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.time() + timeout
        while "[twinkle] ready" not in self.output():
            assert self.proc.poll() is None, f"launch exited early:\n{self.output()}"
            assert time.time() < deadline, f"not ready after {timeout} s:\n{self.output()}"
            time.sleep(0.2)

    def wait_exit(self, timeout: float = 90) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"launch still running after {timeout} s:\n{self.output()}") from None

    def stop(self) -> None:
        stop_process_group(self.proc)


@pytest.fixture
def launches(tmp_path: Path) -> Iterator[list[Launch]]:
    started: list[Launch] = []
    yield started
    for launch in started:
        launch.stop()


def test_a_launch_on_a_busy_port_exits_1_with_one_line_naming_the_port_and_its_owner(
        tmp_path: Path, tiny_model_dir: Path, launches: list[Launch]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launch = Launch(tmp_path, config(tmp_path, tiny_model_dir, port))
        launches.append(launch)

        assert launch.wait_exit(60) == 1
    (line,) = launch.output().strip().splitlines()
    assert f"port {port} on 127.0.0.1 is already in use by PID {os.getpid()}" in line, line
    assert line.startswith("[twinkle] ERROR: ") and "API listening" not in line


def test_a_pool_that_cannot_start_is_tried_three_times_then_given_up_with_its_cause_and_no_ready_line(
        tmp_path: Path, launches: list[Launch]) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # passes check-config, fails when the pool loads it
    launch = Launch(tmp_path, config(tmp_path, broken, free_port()))
    launches.append(launch)

    assert launch.wait_exit(120) == 1
    output = launch.output()
    assert "failed to start (try 1 of 3): " in output and "failed to start (try 2 of 3): " in output
    assert "failed to start 3 times; giving up: " in output
    assert "has no integer vocab_size" in output.split("giving up: ")[1].splitlines()[0]
    assert "Traceback" not in output
    assert "[twinkle] ready" not in output


def test_launch_prints_no_celery_banner_or_per_task_lines_and_v_brings_them_back(
        tmp_path: Path, tiny_model_dir: Path, launches: list[Launch]) -> None:
    outputs = {}
    for args in ((), ("-v",)):
        port = free_port()
        launch = Launch(tmp_path, config(tmp_path, tiny_model_dir, port), *args)
        launches.append(launch)
        launch.wait_ready()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", headers={"X-API-Key": "tml-a"}) as c:
            session = c.post("/create_session", json={"tags": [], "sdk_version": "0"}).json()["session_id"]
            created = c.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                                    "base_model": "tiny-qwen", "lora_config": {"rank": 4}})
            request_id = created.json()["request_id"]
            assert c.post("/retrieve_future", json={"request_id": request_id}).status_code == 200
        time.sleep(0.5)
        launch.stop()
        outputs[args] = launch.output()

    quiet, verbose = outputs[()], outputs[("-v",)]
    for noise in ("[queues]", "[tasks]", " received", " succeeded in ", "Warning"):
        assert noise not in quiet, f"{noise!r} in the default output:\n{quiet}"
    assert "[twinkle] API listening on" in quiet and "[twinkle] ready in" in quiet
    assert "pool model.models-tiny.0 ready" in quiet
    assert quiet.count("DEV MODE") == 1, quiet  # the launcher says it; its API does not say it again
    assert "POST /api/v1/create_session 200" not in quiet  # successful requests' access lines
    assert "[queues]" in verbose and " succeeded in " in verbose
    assert "POST /api/v1/create_session 200" in verbose


def test_clear_persistence_finds_the_embedded_broker_of_the_running_launch(
        tmp_path: Path, tiny_model_dir: Path, launches: list[Launch]) -> None:
    port = free_port()
    config_path = config(tmp_path, tiny_model_dir, port)
    env = {**os.environ, "TWINKLE_STATE_DIR": str(tmp_path / "state")}
    env.pop("TWINKLE_BROKER_URL", None)
    clear = [sys.executable, "-m", "twinkle.server", "clear", "persistence", "-c", str(config_path)]

    before = subprocess.run(clear, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert before.returncode == 1
    assert f"no `twinkle-server launch` of it serving port {port} runs" in before.stderr

    launch = Launch(tmp_path, config_path)
    launches.append(launch)
    launch.wait_ready()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", headers={"X-API-Key": "tml-a"}) as c:
        c.post("/create_session", json={"tags": [], "sdk_version": "0"}).raise_for_status()
    done = subprocess.run(clear, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[1]) > 0, done.stdout
    launch.stop()
    assert not list((tmp_path / "state").glob("launch-*.json")), "the record outlived its launch"


class _Healthz(BaseHTTPRequestHandler):
    body: dict[str, Any] = {"status": "ok"}

    def do_GET(self) -> None:
        data = json.dumps(self.body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_another_server_answering_the_health_check_does_not_make_this_launchs_api_ready() -> None:
    from twinkle.config import parse_config
    from twinkle.keys import Keys
    from twinkle.server.readiness import Readiness

    other = HTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        cfg = parse_config({"http_options": {"host": "127.0.0.1", "port": other.server_address[1]},
                            "applications": [{"name": "server", "route_prefix": "/api/v1",
                                              "import_path": "server", "args": {}}]})
        readiness = Readiness(cfg, None, Keys(""), "ours")  # type: ignore[arg-type]  # no pools: no broker

        assert not readiness._api_answers()
        _Healthz.body = {"status": "ok", "instance": "ours"}
        assert readiness._api_answers()
    finally:
        _Healthz.body = {"status": "ok"}
        other.shutdown()


def test_launch_names_each_set_key_that_has_no_effect_before_it_starts(
        tmp_path: Path, tiny_model_dir: Path, launches: list[Launch]) -> None:
    path = config(tmp_path, tiny_model_dir, free_port())
    path.write_text(path.read_text() + "proxy_location: HeadOnly\n")
    with socket.socket() as taken:  # a busy port ends the launch right after the notes
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        path.write_text(path.read_text().replace(str(yaml.safe_load(path.read_text())["http_options"]["port"]),
                                                 str(taken.getsockname()[1])))
        launch = Launch(tmp_path, path)
        launches.append(launch)
        assert launch.wait_exit(60) == 1
    assert "[twinkle] note: proxy_location: accepted for compatibility, no effect" in launch.output()
