"""What the benchmarks share: the server they launch (`BenchServer`), the raw-HTTP client they drive it with
(one session, one model, a 32-token datum), concurrent clients on threads, and percentiles."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from tests.harness import api_process


def pct(values: list[float], q: float) -> float:
    """The `q`th percentile (0-100) of `values`; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def run_concurrently(run: Callable[[int], None], n: int) -> float:
    """`run(0)` ... `run(n - 1)`, each on its own thread, all started at once; the seconds until all ended."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def one_pool_config(workdir: Path, model_dir: Path, port: int) -> dict[str, Any]:
    """A server config with one mock-backend model pool on the tiny model at `model_dir`, 64 adapters."""
    return {
        "http_options": {"host": "127.0.0.1", "port": port},
        "storage": {"checkpoint_dir": str(workdir / "ckpt")},
        "applications": [
            {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}},
            {"name": "models-tiny", "route_prefix": "/api/v1/model/tiny", "import_path": "model",
             "args": {"backend": "mock", "model_id": str(model_dir), "adapter_config": {"max_loras": 64}}},
        ],
    }


_LAUNCHED: set[BenchServer] = set()  # servers a benchmark started and has not stopped yet


def _stop_launched() -> None:
    for server in list(_LAUNCHED):
        server.stop()


def _stop_launched_on_termination() -> None:
    """A benchmark ended by SIGTERM (`timeout`, a CI cancel) still stops the servers it launched: each is a session of
    its own, which the signal never reaches, and one left running spends the cores the next run measures on."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))  # the finally blocks run
        atexit.register(_stop_launched)


class BenchServer:
    """`twinkle-server launch` of `config` (written to `workdir`/`name`.yaml, its output in `workdir`/server.log),
    with `env` on top of this process's environment and TWINKLE_LOG_LEVEL WARNING unless `env` sets it."""

    def __init__(self, workdir: Path, name: str, config: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.port = int(config["http_options"]["port"])
        self.cfg_path = workdir / f"{name}.yaml"
        self.cfg_path.write_text(yaml.safe_dump(config))
        self.log = (workdir / "server.log").open("w+")
        self.env = {"TWINKLE_LOG_LEVEL": "WARNING", **(env or {})}

    def start(self) -> float:
        """Launch and wait until the server says it is ready; the seconds from launch to ready."""
        started = time.perf_counter()
        _stop_launched_on_termination()
        self.proc = subprocess.Popen([sys.executable, "-m", "twinkle.server", "launch", "-c", str(self.cfg_path)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, **self.env),
                                     start_new_session=True)
        _LAUNCHED.add(self)
        while True:
            self.log.seek(0)
            if "[twinkle] ready" in self.log.read():
                return time.perf_counter() - started
            if self.proc.poll() is not None or time.perf_counter() - started > 120:
                self.log.seek(0)
                raise RuntimeError("server failed to start:\n" + self.log.read())
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def api_process(self) -> psutil.Process:
        return api_process(self.proc.pid)

    def stop(self) -> None:
        _LAUNCHED.discard(self)
        with contextlib.suppress(ProcessLookupError):  # the launch had exited
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1"


def datum(n: int = 32) -> dict[str, Any]:
    """A next-token datum of `n` tokens in the Tinker JSON wire form."""
    tokens = [(7 * i) % 400 + 3 for i in range(n + 1)]
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"},
                               "weights": {"data": [1.0] * n, "dtype": "float32"}}}


class Client:
    def __init__(self, api: str, key: str, *, timeout: float = 60) -> None:
        self.c = httpx.Client(base_url=api, headers={"X-API-Key": key}, timeout=timeout)
        sid = self.c.post("/create_session", json={"tags": []}).json()["session_id"]
        r = self.c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen",
                                               "lora_config": {"rank": 8}}).json()
        assert "model_id" in r, r
        self.wait(r["request_id"])
        self.model = r["model_id"]
        self.session = sid
        self.fb = {"model_id": self.model, "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"}}

    def wait(self, rid: str) -> dict[str, Any]:
        while True:
            body: dict[str, Any] = self.c.post("/retrieve_future", json={"request_id": rid}).json()
            if body.get("type") != "try_again":
                return body

    def step(self) -> None:
        """forward_backward and optim_step, submitted back to back, both waited for."""
        a = self.c.post("/forward_backward", json=self.fb).json()["request_id"]
        b = self.c.post("/optim_step", json={"model_id": self.model, "adam_params": {}}).json()["request_id"]
        self.wait(a)
        self.wait(b)

    def op(self) -> None:
        self.wait(self.c.post("/forward_backward", json=self.fb).json()["request_id"])
