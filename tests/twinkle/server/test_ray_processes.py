"""twinkle/server/ray_processes.py and `twinkle-server stop-ray`: one Ray cluster's processes stop, nothing else."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import free_port
from tests.twinkle.server.process_tree import REPO
from twinkle.server import ray_processes

RAY = Path(sys.executable).with_name("ray")


@pytest.mark.parametrize(
    ("arguments", "belongs"),
    [
        (["gcs_server", "--log_dir=/tmp/x", "--gcs_server_port=6380"], True),
        (["raylet", "--node_id=abc", "--gcs-address=10.0.0.1:6380"], True),
        (["python", "-u", "monitor.py", "--gcs-address", "10.0.0.1:6380"], True),
        (["python", "log_monitor.py", "--gcs_address=head.example:6380"], True),
        (["raylet", "--gcs-address=10.0.0.1:16380"], False),
        (["gcs_server", "--gcs_server_port=63800"], False),
        (["python", "-m", "workers", "--port", "6380"], False),
    ],
)
def test_a_process_belongs_to_the_cluster_whose_gcs_port_its_command_line_names(arguments: list[str],
                                                                                 belongs: bool) -> None:
    assert ray_processes.belongs(arguments, 6380) is belongs


def test_the_gcs_port_is_read_from_host_port_and_ray_client_addresses() -> None:
    assert ray_processes.gcs_port("10.0.0.1:6380") == 6380
    assert ray_processes.gcs_port("ray://head:6380") == 6380
    with pytest.raises(ValueError):
        ray_processes.gcs_port("auto")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_stop_ray_stops_one_clusters_head_and_its_workers_and_leaves_another_clusters_process(
        tmp_path: Path) -> None:
    if importlib.util.find_spec("ray") is None:  # never import Ray here: the session's Ray fixture sets its env first
        pytest.skip("the ray extra is not installed")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    # a process of another cluster, as far as its command line says
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                              f"--gcs-address=127.0.0.1:{port + 1}"])
    try:
        started = subprocess.run(
            [str(RAY), "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", "--num-cpus=1",
             "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
             f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
             f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}"],
            env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        # a driver's actor: a worker process the raylet started
        actor = subprocess.run([sys.executable, "-c", f"""
import os, ray
ray.init(address="127.0.0.1:{port}", log_to_driver=False)
@ray.remote
class Kept:
    def pid(self): return os.getpid()
kept = Kept.options(lifetime="detached", name="kept").remote()
print(ray.get(kept.pid.remote()))
"""], env=env, capture_output=True, text=True, timeout=120)
        assert actor.returncode == 0, actor.stderr
        cluster = [psutil.Process(pid) for pid in ray_processes.of_cluster(port)]
        names = {ray_processes._short_name(process.pid) for process in cluster}
        assert {"gcs_server", "raylet"} <= names and int(actor.stdout.split()[-1]) in {p.pid for p in cluster}

        stopped = subprocess.run([sys.executable, "-m", "twinkle.server", "stop-ray", "--address",
                                  f"127.0.0.1:{port}", "--grace", "5"],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped {len(cluster)} Ray processes of the cluster at 127.0.0.1:{port}: " in stopped.stdout
        _, alive = psutil.wait_procs(cluster, timeout=5)
        assert alive == []
        assert other.poll() is None
    finally:
        for pid in ray_processes.of_cluster(port):
            os.kill(pid, signal.SIGKILL)
        other.kill()
        other.wait()
        time.sleep(0.2)
        shutil.rmtree(temp_dir, ignore_errors=True)
