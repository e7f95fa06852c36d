"""Exactly one consumer per pool queue, with real processes on a Redis of the test's own: a second worker for a
pool refuses to start, naming the first, while the first runs every op; a frozen worker is replaced once its
lease expired, and when it wakes up it exits at once without writing anything."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_foundation import datum, fb_body, new_model
from tests.e2e.test_outage import SLOW, freeze_mid_op, settle, submit
from tests.harness import LaunchedServer, free_port, mock_config, stop_process_group
from tests.private_redis import PrivateRedis
from twinkle.errors import PoolLeaseHeld
from twinkle.pool_exit import PoolExit
from twinkle.pool_lease import PoolLease

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
QUEUE = "model.models-tiny.0"
LEASE_SECONDS = 5.0
MEDIUM = [datum([(7 * i) % 500 + 3 for i in range(400)]) for _ in range(8)]  # a fraction of a second on mock



def lease_config(tmp: Path, model_dir: Path, broker: PrivateRedis) -> dict[str, Any]:
    config = mock_config(model_dir, tmp / "checkpoints", port=free_port(), db=0)
    config["broker"].update(url=broker.url, pool_lease_seconds=LEASE_SECONDS)
    return config


def started(argv: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TWINKLE_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def worker(config_path: Path, log: Path) -> subprocess.Popen[bytes]:
    """A pool worker run on its own, as `twinkle-server launch --only worker` runs it on another node."""
    return started([sys.executable, "-m", "workers", "-c", str(config_path), "--app", "models-tiny"], log)


def wait_for_heartbeat_of(server: LaunchedServer, pid: int, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while server.worker_pid(wait=timeout) != pid:
        assert time.time() < deadline, f"pid {pid} never became the pool's worker"
        time.sleep(0.2)


def wait_until_ready(launcher: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while "[twinkle] ready" not in log.read_text(errors="replace"):
        assert launcher.poll() is None and time.time() < deadline, log.read_text(errors="replace")
        time.sleep(0.1)


def outcomes(server: LaunchedServer, request_ids: list[str]) -> dict[str, dict[bytes, bytes]]:
    """The records as the ops' outcomes left them: without the usage mark (twinkle/usage.py), which the worker
    that failed an op adds after the failure is visible, so it can land after a snapshot."""
    return {rid: {field: value for field, value in server.redis.hgetall(server.keys.future(rid)).items()
                  if field != b"metered"} for rid in request_ids}


def test_a_second_launcher_for_a_pool_is_refused_naming_the_holder_while_every_op_completes(
        tmp_path: Path, tiny_model_dir: Path, broker: PrivateRedis) -> None:
    server = LaunchedServer(lease_config(tmp_path, tiny_model_dir, broker), tmp_path / "server.yaml",
                            tmp_path / "server.log")
    server.start()
    second_log = tmp_path / "second.log"
    second = None
    try:
        with server.client("tml-lease") as c:
            model = new_model(c)
            holder = server.worker_pid()
            # as on another node: its launch records are its own, so only the pool's lease can refuse it
            second = started([sys.executable, "-m", "twinkle.server", "launch", "-c", str(server.config_path),
                              "--only", "worker", "models-tiny"], second_log,
                             TWINKLE_STATE_DIR=str(tmp_path / "node-b-state"))
            submitted: list[str] = []
            deadline = time.time() + 120
            while second.poll() is None:  # the holder is busy, its next ops queued, all along the second one's life
                assert time.time() < deadline, f"the second launcher never gave up:\n{second_log.read_text()}"
                if server.redis.llen(QUEUE) < 3:
                    submitted.append(submit(c, "/forward_backward", fb_body(model, MEDIUM)))
                    submitted.append(submit(c, "/optim_step", {"model_id": model,
                                                               "adam_params": {"learning_rate": 0.01}}))
                time.sleep(0.05)
            answers = {rid: settle(c, rid) for rid in submitted}
            assert len(submitted) >= 10
            assert all("error" not in body for body in answers.values()), [
                body for body in answers.values() if "error" in body]
            refused = second_log.read_text()
            assert second.returncode == 1, refused
            line = next(line for line in refused.splitlines() if "failed to start (try 1 of 3)" in line)
            assert f"pool queue {QUEUE} is already consumed by pid {holder} on host" in line
            assert "since 20" in line and "lease expires in" in line and "stop that worker first" in line
            assert "giving up" in refused and f"pool {QUEUE} ready" not in refused
            assert server.worker_pid() == holder and "exited with code" not in server.log()
    finally:
        if second is not None:
            stop_process_group(second)
        server.stop()


def test_a_frozen_worker_is_replaced_after_its_lease_and_exits_at_once_when_it_wakes_without_writing(
        tmp_path: Path, tiny_model_dir: Path, broker: PrivateRedis) -> None:
    config = lease_config(tmp_path, tiny_model_dir, broker)
    config_path = tmp_path / "server.yaml"
    config_path.write_text(yaml.safe_dump(config))
    server = LaunchedServer(config, config_path, tmp_path / "api.log")
    api = started([sys.executable, "-m", "twinkle.server", "launch", "-c", str(config_path), "--only", "api"],
                  server.log_path)
    first = worker(config_path, tmp_path / "first.log")
    processes = [api, first]
    try:
        wait_until_ready(api, server.log_path)
        wait_for_heartbeat_of(server, first.pid)
        with server.client("tml-lease-frozen") as c:
            model = new_model(c)
            assert "error" not in settle(c, submit(c, "/forward_backward", fb_body(model, [datum([1, 2, 3])])))
            steps = [submit(c, "/forward_backward", fb_body(model, SLOW)) for _ in range(6)]
            running = freeze_mid_op(server, first.pid, steps)
            frozen_at = time.monotonic()
            done_before = {rid for rid in steps if server.redis.hget(server.keys.future(rid), "status") == b"completed"}

            with pytest.raises(PoolLeaseHeld, match=f"consumed by pid {first.pid}"):  # frozen, not yet expired
                PoolLease(server.redis, server.keys, QUEUE, LEASE_SECONDS).acquire()
            while server.redis.exists(server.keys.pool_lease(QUEUE)):
                assert time.monotonic() - frozen_at < LEASE_SECONDS + 30, "the frozen worker's lease never expired"
                time.sleep(0.1)
            second = worker(config_path, tmp_path / "second.log")
            processes.append(second)
            wait_for_heartbeat_of(server, second.pid)

            answers = {rid: settle(c, rid) for rid in steps}
            assert answers[running]["code"] == "adapter_state_lost", answers[running]  # its adapter froze with it
            assert all(("error" not in body) if rid in done_before else body.get("code") == "adapter_state_lost"
                       for rid, body in answers.items()), answers  # the frozen worker's adapter is gone with it
            before = outcomes(server, steps)

            os.kill(first.pid, signal.SIGCONT)
            woke = time.monotonic()
            assert first.wait(timeout=30) == PoolExit.LEASE_LOST
            assert time.monotonic() - woke < 5
            assert outcomes(server, steps) == before  # it wrote nothing, not even the op it was running
            assert "another worker took over" in (tmp_path / "first.log").read_text()

            assert second.poll() is None and server.worker_pid() == second.pid
            assert "error" not in settle(c, submit(c, "/forward_backward", fb_body(new_model(c), [datum([1, 2, 3])])))

            stop_process_group(second)  # a clean stop hands the queue on at once: its lease is gone
            assert second.returncode == 0 and not server.redis.exists(server.keys.pool_lease(QUEUE))
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            stop_process_group(process)
