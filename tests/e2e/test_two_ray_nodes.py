"""A pool's data-parallel ranks on two Ray nodes, as an operator starts them (`ray start --head`, then
`ray start --address` for the second node, here both on this machine): each rank lands on its own node, the
adapter trains as on one replica, and `twinkle-server stop-ray` stops both nodes of that cluster and nothing else."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_foundation import datum, fb_body, wait
from tests.harness import LaunchedServer, free_port, mock_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RAY = str(Path(sys.executable).with_name("ray"))
PIDS = re.compile(r"device group \S+: 2 ranks .*, pids \[(\d+), (\d+)\]")
DATA = [datum([5 + (i * 7) % 50 for i in range(k, k + 16)]) for k in range(3)]  # shards of 2 and 1


def ray_env() -> dict[str, str]:
    # a second node on loopback is what Ray calls a multi-node cluster on one machine; Ray refuses it unless asked
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def cluster_processes(port: int) -> list[psutil.Process]:
    """The processes of the Ray cluster whose GCS listens on `port` (its GCS, raylets and their workers)."""
    needle = f"127.0.0.1:{port}"
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(needle in part for part in process.info["cmdline"] or ()) or any(
                part in (f"--gcs_server_port={port}", f"--port={port}") for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[int]:
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="ray2n-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--resources", '{"rank_slot": 1}',
              "--disable-usage-stats"]
    subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                    "--temp-dir", str(temp), *common], env=ray_env(), check=True, capture_output=True, timeout=120)
    try:
        subprocess.run([RAY, "start", "--address", f"127.0.0.1:{port}", *common], env=ray_env(), check=True,
                       capture_output=True, timeout=120)
        yield port
    finally:
        subprocess.run([sys.executable, "-m", "twinkle.server", "stop-ray", "--address", f"127.0.0.1:{port}"],
                       env=ray_env(), capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def spread(two_nodes: int, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
           ) -> Iterator[LaunchedServer]:
    tmp = tmp_path_factory.mktemp("two-nodes")
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=6,
                         model_args={"device_group": {"name": "model", "ranks": 2, "device_type": "cpu"},
                                     "device_mesh": {"dp_size": 2}})
    config["applications"][1]["deployments"][0]["ray_actor_options"] = {"num_cpus": 1, "resources": {"rank_slot": 1}}
    config["ray"] = {"address": f"127.0.0.1:{two_nodes}"}
    server = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log", env=ray_env())
    server.start(timeout=240)
    yield server
    server.stop()


def losses(server: LaunchedServer, key: str) -> list[float]:
    with server.client(key) as c:
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        created = c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen",
                                                "lora_config": {"rank": 4, "seed": 5}}).json()
        model = wait(c, created["request_id"])["model_id"]
        out = []
        for _ in range(3):
            fb = c.post("/forward_backward", json=fb_body(model, DATA)).json()["request_id"]
            opt = c.post("/optim_step", json={"model_id": model, "adam_params": {"learning_rate": 0.05}}).json()
            out.append(float(wait(c, fb)["metrics"]["loss:sum"]))
            assert "error" not in wait(c, opt["request_id"])
        return out


def test_ranks_on_two_nodes_train_as_one_replica_and_stop_ray_stops_that_cluster_only(
        two_nodes: int, spread: LaunchedServer, mock_server: LaunchedServer, ray_address: str) -> None:
    found = PIDS.search(spread.log())
    assert found, spread.log()[-3000:]
    raylets = {psutil.Process(int(pid)).parent().pid for pid in found.groups()}  # type: ignore[union-attr]
    assert len(raylets) == 2  # one rank under each node's raylet
    assert losses(spread, "tml-two-nodes") == pytest.approx(losses(mock_server, "tml-one-node"), rel=1e-5)

    spread.stop()
    assert cluster_processes(two_nodes)
    done = subprocess.run([sys.executable, "-m", "twinkle.server", "stop-ray", "--address", f"127.0.0.1:{two_nodes}"],
                          env=ray_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.time() + 30
    while alive(cluster_processes(two_nodes)) and time.time() < deadline:
        time.sleep(0.5)
    assert not alive(cluster_processes(two_nodes))
    assert alive(cluster_processes(int(ray_address.rsplit(":", 1)[1])))  # the test session's own Ray lives on


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    live = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                live.append(process)
        except psutil.NoSuchProcess:
            pass
    return live
