"""The launcher's children end with it, a successor clears what a dead launcher left, and the roles of a launch can
be placed: one pool's replicas by `--replica`, several APIs on one Redis by `--host` / `--port`.

Every launch here runs against a redis-server of the test's own and keeps its launch records in the test's own
state dir.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
import yaml

from tests.e2e.test_foundation import new_model
from tests.harness import free_port, mock_config
from tests.private_redis import PrivateRedis
from tests.twinkle.server.process_tree import dead_pid
from tests.twinkle.server.test_launch import Launch as LaunchBase
from twinkle.keys import Keys
from twinkle.server import launch_record, process_table
from twinkle.server.launch_record import ChildRecord, LaunchRecord

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
KEYS = Keys("")


class Launch(LaunchBase):
    """One `python -m twinkle.server launch` with its output in a file, and the pool workers it started."""

    def workers(self) -> list[psutil.Process]:
        return [child for child in psutil.Process(self.proc.pid).children()
                if child.cmdline()[1:3] == ["-m", "workers"]]



@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    started: list[Launch] = []
    yield started
    for launch in started:
        launch.stop()


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(launch_record.STATE_DIR_ENV, str(tmp_path / "state"))
    return tmp_path / "state"


def write_config(tmp: Path, model_dir: Path, broker: PrivateRedis, **kw: Any) -> tuple[Path, dict[str, Any]]:
    config = mock_config(model_dir, tmp / "checkpoints", port=free_port(), db=0, **kw)
    config["broker"]["url"] = broker.url
    path = tmp / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def heartbeat_pid(broker: PrivateRedis, queue: str, wait: float = 30) -> int | None:
    r = redis.Redis.from_url(broker.url)
    deadline = time.time() + wait
    while not (raw := r.get(KEYS.pool_heartbeat(queue))):
        if time.time() > deadline:
            return None
        time.sleep(0.2)
    return int(json.loads(raw)["pid"])


@dataclass(frozen=True)
class Orphan:
    pid: int
    create_time_ticks: int


def start_orphan(argv: list[str], log: Path) -> Orphan:
    """A process in a session of its own whose parent is gone, as a child that outlived its launcher (one started
    without the death signal): init, not this test, reaps it."""
    starter = subprocess.run([sys.executable, "-c", (
        "import subprocess, sys\n"
        f"child = subprocess.Popen({argv!r}, start_new_session=True, stdout=open({str(log)!r}, 'wb'),"
        " stderr=subprocess.STDOUT)\n"
        "print(child.pid)")], cwd=REPO, capture_output=True, text=True, check=True)
    pid = int(starter.stdout)
    return Orphan(pid, process_table.started(pid) or 0)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def test_a_sigkilled_launcher_takes_its_children_and_their_private_ray_along_and_frees_the_api_port(
        tmp_path: Path, tiny_model_dir: Path, broker: PrivateRedis, launches: list[Launch], state_dir: Path) -> None:
    path, config = write_config(tmp_path, tiny_model_dir, broker)
    model_args = config["applications"][1]["args"]
    model_args["device_group"] = {"name": "model", "ranks": 2, "device_type": "cpu"}
    model_args["device_mesh"] = {"dp_size": 2}  # a private Ray: GCS, raylet, agents and two rank actors
    path.write_text(yaml.safe_dump(config))
    launch = Launch(tmp_path, path)
    launches.append(launch)
    launch.wait_ready(240)
    tree = psutil.Process(launch.proc.pid).children(recursive=True)
    commands = [" ".join(process.cmdline()) for process in tree]
    assert sum("RankActor" in command for command in commands) == 2, commands
    assert any("raylet" in command for command in commands), commands

    killed_at = time.time()
    launch.proc.send_signal(signal.SIGKILL)
    launch.proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=10)
    took = time.time() - killed_at

    assert alive == [], f"still running {took:.1f} s after the launcher was killed: {alive}"
    print(f"every one of {len(tree)} processes ended {took:.1f} s after the launcher was SIGKILLed")
    assert port_free("127.0.0.1", config["http_options"]["port"])
    assert f"cleared what launcher PID {launch.proc.pid} left running: " in launch.output()
    assert not list(state_dir.glob("launch-*.json")), "the reaper leaves no record of a launch that is gone"


def test_the_next_launch_clears_a_worker_a_dead_launcher_left_consuming_before_it_starts(
        tmp_path: Path, tiny_model_dir: Path, broker: PrivateRedis, launches: list[Launch]) -> None:
    path, _ = write_config(tmp_path, tiny_model_dir, broker)
    leftover = start_orphan([sys.executable, "-m", "workers", "-c", str(path), "--app", "models-tiny",
                             "--replica", "0"], tmp_path / "leftover.log")
    try:
        assert heartbeat_pid(broker, "model.models-tiny.0", wait=60) == leftover.pid
        config_path = str(path.resolve())
        launch_record.write(LaunchRecord(
            dead_pid(), 0, broker.url, config_path, started=1,
            name=launch_record.record_name(config_path, "worker", "models-tiny", [0], 0, 0),
            children=(ChildRecord("worker models-tiny#0", leftover.pid, leftover.create_time_ticks,
                                  "model.models-tiny.0"),)))

        launch = Launch(tmp_path, path)
        launches.append(launch)
        launch.wait_ready()

        output = launch.output()
        cleared = f"left running: worker models-tiny#0 (PID {leftover.pid})"
        assert cleared in output and output.index(cleared) < output.index("API listening on"), output
        assert not process_table.runs(leftover.pid, leftover.create_time_ticks)
        (worker,) = launch.workers()
        assert heartbeat_pid(broker, "model.models-tiny.0") == worker.pid
    finally:
        if process_table.runs(leftover.pid, leftover.create_time_ticks):
            os.killpg(leftover.pid, signal.SIGKILL)


def test_replica_starts_only_the_named_replica_so_one_pools_replicas_run_from_separate_launches(
        tmp_path: Path, tiny_model_dir: Path, broker: PrivateRedis, launches: list[Launch]) -> None:
    path, _ = write_config(tmp_path, tiny_model_dir, broker, replicas=2)
    node_b = Launch(tmp_path, path, "--only", "worker", "models-tiny", "--replica", "1")
    launches.append(node_b)
    node_b.wait_ready()

    (replica_1,) = node_b.workers()
    assert replica_1.cmdline()[-2:] == ["--replica", "1"]
    assert heartbeat_pid(broker, "model.models-tiny.1") == replica_1.pid
    assert heartbeat_pid(broker, "model.models-tiny.0", wait=3) is None

    node_a = Launch(tmp_path, path, "--only", "worker", "models-tiny", "--replica", "0")
    launches.append(node_a)
    node_a.wait_ready()
    (replica_0,) = node_a.workers()
    assert heartbeat_pid(broker, "model.models-tiny.0") == replica_0.pid

    again = Launch(tmp_path, path, "--only", "worker", "models-tiny", "--replica", "1")
    launches.append(again)
    assert again.proc.wait(timeout=60) == 1
    assert f"launcher PID {node_b.proc.pid} ({path.resolve()}) already runs model.models-tiny.1" in again.output()


def test_a_second_api_on_its_own_host_and_port_answers_the_futures_the_first_one_accepted(
        tmp_path: Path, tiny_model_dir: Path, broker: PrivateRedis, launches: list[Launch]) -> None:
    path, config = write_config(tmp_path, tiny_model_dir, broker)
    first = Launch(tmp_path, path)
    launches.append(first)
    first.wait_ready()
    port = free_port()
    second = Launch(tmp_path, path, "--only", "api", "--host", "127.0.0.2", "--port", str(port))
    launches.append(second)
    second.wait_ready()

    assert f"API listening on http://127.0.0.2:{port}" in second.output()
    assert port_free("127.0.0.1", port), "the second API listens where --host says, not where the config says"
    headers = {"X-API-Key": "tml-two-apis"}
    with httpx.Client(base_url=f"http://127.0.0.1:{config['http_options']['port']}/api/v1", headers=headers,
                      timeout=60) as one, httpx.Client(base_url=f"http://127.0.0.2:{port}/api/v1", headers=headers,
                                                       timeout=60) as two:
        model = new_model(one)
        accepted = one.post("/save_weights_for_sampler", json={"model_id": model, "path": "s1"})
        assert accepted.status_code == 200, accepted.text
        answered = two.post("/retrieve_future", json={"request_id": accepted.json()["request_id"]})
        while answered.json().get("type") == "try_again":
            answered = two.post("/retrieve_future", json={"request_id": accepted.json()["request_id"]})

    assert answered.status_code == 200 and "path" in answered.json(), answered.text
