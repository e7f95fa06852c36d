"""`twinkle-server launch`: start the broker, the API and one worker per pool, and supervise them.

Children are plain subprocesses in their own process group. A child that dies is restarted (its
queue's unacked messages are put back at the head first, so nothing queued is lost), and SIGINT /
SIGTERM stops everything: workers get a warm shutdown, stragglers are killed, nothing is orphaned.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from twinkle.broker import EmbeddedBroker, restore_unacked
from twinkle.catalog import model_queue, processor_queue, sampler_queue
from twinkle.keys import Keys
from twinkle.pool_exit import exit_reason
from twinkle.state.persistence import restore_snapshot, save_snapshot
from twinkle.telemetry.pool_status import PoolStatusPrinter

log = logging.getLogger("twinkle.launcher")
STOP_GRACE_SECONDS = 20.0
READY_TIMEOUT_SECONDS = 600.0
SNAPSHOT_SECONDS = 10.0


@dataclass
class Child:
    name: str
    argv: list[str]
    queue: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        env = dict(os.environ, **self.env)
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True)
        self.started_at = time.time()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def plan_children(config_path: str, config: Any, only: str | None, only_name: str | None) -> list[Child]:
    py = sys.executable
    children: list[Child] = []
    if only in (None, "api"):
        children.append(Child("api", [py, "-m", "api", "-c", config_path]))
    if only in (None, "worker"):
        for app in config.model_apps():
            if only_name and app.name != only_name:
                continue
            replicas = _replicas(app)
            for replica in range(replicas):
                children.append(Child(f"worker {app.name}#{replica}", [py, "-m", "workers", "-c", config_path,
                                      "--app", app.name, "--replica", str(replica)],
                                      queue=model_queue(app.name, replica), env=_app_env(app)))
        for app in config.sampler_apps():
            if only_name and app.name != only_name:
                continue
            children.append(Child(f"worker {app.name}", [py, "-m", "workers", "-c", config_path, "--app", app.name],
                                  queue=sampler_queue(app.name), env=_app_env(app)))
        for app in config.processor_apps():
            if only_name and app.name != only_name:
                continue
            children.append(Child(f"worker {app.name}", [py, "-m", "workers", "-c", config_path, "--app", app.name],
                                  queue=processor_queue(app.name), env=_app_env(app)))
    if only == "flower" or (only is None and config.flower.enabled):
        children.append(Child("flower", [py, "-m", "twinkle.server.flower", "-c", config_path]))
    return children


def _replicas(app: Any) -> int:
    for deployment in app.deployments or []:
        if deployment.autoscaling_config is not None:
            return max(1, int(deployment.autoscaling_config.min_replicas or 1))
    return 1


def _app_env(app: Any) -> dict[str, str]:
    env: dict[str, str] = {}
    if getattr(app.args, "backend", None) == "mock" or getattr(app.args, "sampler_type", None) == "mock":
        # the mock's small matrices run slower with BLAS threads fighting the API for the cores
        env["OPENBLAS_NUM_THREADS"] = os.environ.get("OPENBLAS_NUM_THREADS", "1")
    for deployment in app.deployments or []:
        if deployment.runtime_env is not None:
            env.update({k: str(v) for k, v in (deployment.runtime_env.env_vars or {}).items()})
    return env


class Supervisor:
    def __init__(self, children: list[Child], r: redis.Redis, keys: Keys) -> None:
        self.children = children
        self.r = r
        self.keys = keys
        self.stopping = False

    def start_all(self) -> None:
        for child in self.children:
            if child.queue:
                restore_unacked(self.r, child.queue)
            child.start()

    def check(self) -> None:
        for child in self.children:
            if self.stopping or child.alive():
                continue
            code = child.proc.returncode if child.proc else None
            why = f" ({exit_reason(code)})" if exit_reason(code) else ""
            log.error("%s exited with code %s%s; restarting it", child.name, code, why)
            print(f"[twinkle] {child.name} exited with code {code}{why}; restarting", flush=True)
            _kill_leftovers(child)
            if child.queue:
                restored = restore_unacked(self.r, child.queue)
                if restored:
                    log.warning("put %d unacked message(s) back at the head of %s", restored, child.queue)
            child.restarts += 1
            if time.time() - child.started_at < 2:
                time.sleep(min(10, child.restarts))  # crash loop: back off instead of spinning
            child.start()

    def stop_all(self) -> None:
        self.stopping = True
        for child in self.children:
            if child.alive():
                assert child.proc is not None
                os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.time() + STOP_GRACE_SECONDS
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()


def _kill_leftovers(child: Child) -> None:
    """Kill what a dead worker left in its process group (a private Ray instance's agents outlive it)."""
    if child.proc is not None:
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_until_ready(config: Any, sup: Supervisor, only: str | None, stop: dict[str, bool],
                     status: PoolStatusPrinter | None = None) -> None:
    """Print where the API listens and each pool as it becomes ready."""
    import httpx

    pending_pools = {c.queue for c in sup.children if c.queue}
    api_up = only not in (None, "api")
    host = config.http_options.host
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{config.http_options.port}"
    server = config.server_app()
    prefix = (server.route_prefix if server else "/api/v1").rstrip("/")
    deadline = time.time() + READY_TIMEOUT_SECONDS
    while (pending_pools or not api_up) and time.time() < deadline and not stop["requested"]:
        sup.check()
        if not api_up:
            try:
                httpx.get(f"{base}{prefix}/healthz", timeout=1).raise_for_status()
                api_up = True
                print(f"[twinkle] API listening on http://{host}:{config.http_options.port}", flush=True)
            except Exception:  # noqa: BLE001 - not up yet
                pass
        for queue in list(pending_pools):
            raw = sup.r.get(sup.keys.pool_heartbeat(queue))
            if raw:
                pending_pools.discard(queue)
                print(f"[twinkle] pool {queue} ready ({json.loads(raw).get('pid')})", flush=True)
        if status is not None:
            status.maybe_print(sup.children)
        time.sleep(0.1)


def launch(config_path: str, config: Any, only: str | None = None, only_name: str | None = None,
           namespace: str = "twinkle_cluster") -> int:
    logging.basicConfig(level=os.environ.get("TWINKLE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config_path = str(Path(config_path).resolve())
    broker: EmbeddedBroker | None = None
    url = os.environ.get("TWINKLE_BROKER_URL") or config.broker.url
    if not url:
        if only is not None:
            print("--only needs a shared broker: set broker.url in the config.", file=sys.stderr)
            return 2
        broker = EmbeddedBroker()
        url = broker.start()
        print(f"[twinkle] embedded Valkey broker at {url}", flush=True)
    os.environ["TWINKLE_BROKER_URL"] = url
    os.environ["TWINKLE_RAY_NAMESPACE"] = namespace
    r = redis.Redis.from_url(url)
    keys = Keys(config.persistence.key_prefix)
    if not config.auth.api_keys and not config.auth.keys_file:
        print("[twinkle] WARNING: no API keys configured - DEV MODE: any key is accepted and each distinct "
              "key is its own tenant. Configure auth.api_keys or auth.keys_file for shared servers.", flush=True)
    snapshot_path = config.persistence.file_path if config.persistence.mode == "file" and only is None else None
    if snapshot_path:
        print(f"[twinkle] restored {restore_snapshot(r, snapshot_path)} durable records from {snapshot_path}",
              flush=True)
    sup = Supervisor(plan_children(config_path, config, only, only_name), r, keys)
    status = PoolStatusPrinter(r, keys)
    stop = {"requested": False}

    def _on_signal(signum: int, _frame: Any) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    started = time.time()
    try:
        sup.start_all()
        wait_until_ready(config, sup, only, stop, status)
        print(f"[twinkle] ready in {time.time() - started:.1f} s; Ctrl-C to stop", flush=True)
        last_snapshot = time.time()
        while not stop["requested"]:
            sup.check()
            status.maybe_print(sup.children)
            if snapshot_path and time.time() - last_snapshot > SNAPSHOT_SECONDS:
                save_snapshot(r, keys, snapshot_path)
                last_snapshot = time.time()
            time.sleep(0.2)
    finally:
        print("[twinkle] stopping", flush=True)
        sup.stop_all()
        if snapshot_path:
            save_snapshot(r, keys, snapshot_path)
        if broker is not None:
            broker.stop()
    return 0
