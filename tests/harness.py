"""Launch a real Twinkle server (the `twinkle-server launch` CLI) for end-to-end tests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis
import redis.asyncio as aioredis
import uvicorn
import yaml

from twinkle.keys import Keys

REDIS_HOST = os.environ.get("TWINKLE_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("TWINKLE_TEST_REDIS_PORT", "6379"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_sends() -> Iterator[list[Any]]:
    """Every packed command (or pipeline) any redis-py connection of this process sends while inside: one entry a
    round trip."""
    from redis.connection import Connection

    sent: list[Any] = []
    original = Connection.send_packed_command

    def counted(self: Connection, command: Any, check_health: bool = True) -> None:
        sent.append(command)
        original(self, command, check_health)

    Connection.send_packed_command = counted  # type: ignore[method-assign,assignment]
    try:
        yield sent
    finally:
        Connection.send_packed_command = original  # type: ignore[method-assign]


def wait_for(condition: Callable[[], object], timeout: float = 10) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def require_redis() -> None:
    try:
        redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:  # pragma: no cover - environment problem
        raise RuntimeError(f"The tests need Redis at {REDIS_HOST}:{REDIS_PORT} ({exc}); .ci/run starts one.") from exc


@asynccontextmanager
async def async_redis(db: int) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the tests' Redis, database `db`, closed afterwards."""
    require_redis()
    client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db)
    try:
        yield client
    finally:
        await client.aclose()


@asynccontextmanager
async def scratch_keys(db: int = 2) -> AsyncIterator[tuple[aioredis.Redis, Keys]]:
    """An asyncio client and keys under a prefix of their own, whose keys are deleted afterwards."""
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    async with async_redis(db) as r:
        try:
            yield r, keys
        finally:
            async for key in r.scan_iter(f"{keys.root}*"):
                await r.delete(key)


@dataclass
class ApiInProcess:
    """The API app served by uvicorn in the test's own event loop, on its own key prefix in Redis database 2."""

    http: httpx.AsyncClient  # its /api/v1, sending the test's API key
    app: Any
    redis: redis.Redis
    keys: Keys


@asynccontextmanager
async def api_in_process(api_key: str, *, long_poll_seconds: float,
                         pool_args: dict[str, Any] | None = None) -> AsyncIterator[ApiInProcess]:
    """An API with one mock model pool configured (no worker runs it: submitted ops stay queued); `pool_args` go
    to that pool's args. Its keys are deleted afterwards."""
    from api.app import create_app  # the API's imports, only for the tests that serve it
    from twinkle.config import parse_config

    require_redis()
    prefix = f"test-api-{uuid.uuid4().hex[:8]}:"
    config = parse_config({"persistence": {"key_prefix": prefix}, "applications": [
        {"name": "m", "route_prefix": "/api/v1/model/x", "import_path": "model",
         "args": {"backend": "mock", "model_id": "/nonexistent/x", **(pool_args or {})}}]})
    app = create_app(config, f"redis://{REDIS_HOST}:{REDIS_PORT}/2", long_poll_seconds=long_poll_seconds)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "the server did not start"
        await asyncio.sleep(0.01)
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=2)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/api/v1", headers={"X-API-Key": api_key},
                                     timeout=30) as http:
            yield ApiInProcess(http, app, r, Keys(prefix))
    finally:
        server.should_exit = True
        await serving
        for key in r.scan_iter(match=f"{prefix}*"):
            r.delete(key)
        r.close()


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), SIGKILL after 40 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def api_process(launcher_pid: int) -> psutil.Process:
    """The API process among the descendants of the `twinkle-server launch` process `launcher_pid`."""
    for child in psutil.Process(launcher_pid).children(recursive=True):
        if child.cmdline()[1:3] == ["-m", "api"]:
            return child
    raise AssertionError("no API process under the launcher")


def mock_config(model_dir: Path, checkpoint_dir: Path, *, port: int, db: int, backend: str = "mock",
                max_loras: int = 32, extra_apps: list[dict[str, Any]] | None = None,
                server_config: dict[str, Any] | None = None, sampler: bool = False,
                adapter_config: dict[str, Any] | None = None, max_length: int = 2048,
                processor: bool = False, queue_config: dict[str, Any] | None = None,
                auth: dict[str, Any] | None = None, replicas: int = 1,
                clock: dict[str, Any] | None = None, model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    apps: list[dict[str, Any]] = [
        {"name": "server", "route_prefix": "/api/v1", "import_path": "server",
         "args": {"server_config": server_config or {}}},
        {"name": "models-tiny", "route_prefix": "/api/v1/model/tiny-qwen", "import_path": "model",
         "args": {"backend": backend, "model_id": str(model_dir), "max_length": max_length,
                  "adapter_config": {"max_loras": max_loras, **(adapter_config or {})},
                  "queue_config": queue_config or {}, **({"clock": clock} if clock else {}), **(model_args or {})},
         "deployments": [{"name": "ModelManagement",
                          "autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}}]},
    ]
    if sampler:
        apps.append({"name": "sampler-tiny", "route_prefix": "/api/v1/sampler/tiny-qwen", "import_path": "sampler",
                     "args": {"model_id": str(model_dir), "sampler_type": "mock" if backend == "mock" else "torch"}})
    if processor:
        apps.append({"name": "processor", "route_prefix": "/api/v1/processor", "import_path": "processor",
                     "args": {"ncpu_proc_per_node": 2}})
    apps.extend(extra_apps or [])
    return {
        "http_options": {"host": "127.0.0.1", "port": port},
        "broker": {"url": f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"},
        "storage": {"checkpoint_dir": str(checkpoint_dir)},
        "auth": auth or {},
        "applications": apps,
    }


@dataclass
class LaunchedServer:
    config: dict[str, Any]
    config_path: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config['http_options']['port']}"

    @property
    def api(self) -> str:
        return self.base_url + "/api/v1"

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.config["broker"]["url"])

    keys = Keys("")

    def start(self, timeout: float = 90) -> None:
        self.redis.flushdb()
        self.config_path.write_text(yaml.safe_dump(self.config))
        log = self.log_path.open("wb")
        env = {**os.environ, "TWINKLE_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", **self.env}  # self.env wins
        self.proc = subprocess.Popen([sys.executable, "-m", "twinkle.server", "launch", "-c", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            if "[twinkle] ready" in self.log():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)

    def api_process(self) -> psutil.Process:
        assert self.proc is not None
        return api_process(self.proc.pid)

    def client(self, api_key: str = "tml-test-key") -> httpx.Client:
        return httpx.Client(base_url=self.api, headers={"X-API-Key": api_key}, timeout=60)

    def worker_pid(self, queue: str = "model.models-tiny.0", wait: float = 15.0) -> int:
        """The pid in the pool's heartbeat; waits for one, since a restarted broker holds none until the
        worker's next beat (every 2 s, once it has reconnected)."""
        import json

        deadline = time.time() + wait
        while not (raw := self.redis.get(self.keys.pool_heartbeat(queue))):
            assert time.time() < deadline, f"no heartbeat of {queue} for {wait} s"
            time.sleep(0.2)
        return int(json.loads(raw)["pid"])


def launch(tmp: Path, model_dir: Path, db: int, **kw: Any) -> LaunchedServer:
    require_redis()
    env = kw.pop("env", {})
    cfg = mock_config(model_dir, tmp / "checkpoints", port=free_port(), db=db, **kw)
    server = LaunchedServer(cfg, tmp / "server.yaml", tmp / "server.log", env=env)
    server.start()
    return server
