"""`twinkle-server launch`: start the broker, the API and one worker per pool, and supervise them.

Children are plain subprocesses, each leading a session of its own. A child that dies is restarted (its
queue's unacked messages are put back at the head first, so nothing queued is lost), and SIGINT /
SIGTERM stops everything: workers get a warm shutdown, stragglers are killed, nothing is orphaned.

A launcher that dies without stopping (SIGKILL, the OOM killer) takes its children along: the kernel kills
each child with it (twinkle/server/parent_death.py), and its reaper kills what the children started
(twinkle/server/reaper.py). Every child is named in the launch record (twinkle/server/launch_record.py), and
the next launch of the same roles clears whatever a dead launcher still left before it starts anything
(twinkle/server/leftovers.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from twinkle import liveness
from twinkle.broker import EmbeddedBroker
from twinkle.catalog import model_queue, processor_queue, sampler_queue
from twinkle.config.apps import ModelApp, SamplerApp
from twinkle.config.model_dirs import is_mock
from twinkle.keys import Keys
from twinkle.launched_process import DEV_MODE_SAID_ENV, INSTANCE_ENV, START_FAILURE_ENV
from twinkle.pool_exit import exit_reason
from twinkle.pool_lease import restore_if_vacant
from twinkle.server import (
    launch_record,
    leftovers,
    parent_death,
    process_table,
    reaper,
    replica_choice,
    startup,
    verbosity,
)
from twinkle.server.hang_watch import HangWatch
from twinkle.server.port_check import port_taken
from twinkle.server.readiness import Readiness, new_instance_id
from twinkle.server.startup import StartAttempts
from twinkle.state.persistence import restore_snapshot, save_snapshot
from twinkle.telemetry.pool_status import PoolStatusPrinter

if TYPE_CHECKING:
    from twinkle.config.apps import Application
    from twinkle.config.server_config import ServerConfig

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
    proc_started: int = 0  # the process's start time (process_table), which tells a reused pid apart
    restarts: int = 0
    started_at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    liveness_file: str = ""  # pool workers: rewritten every second while the process runs (twinkle/liveness.py)
    awaiting_broker: bool = False  # dead, and its restart waits for the broker to answer again
    attempts: StartAttempts | None = None  # children the launcher can see become ready (API, pools)

    def start(self) -> None:
        env = dict(os.environ, **self.env)
        if self.liveness_file:
            Path(self.liveness_file).unlink(missing_ok=True)
            env[liveness.ENV] = self.liveness_file
        if self.attempts is not None:
            self.attempts.started()
            env[START_FAILURE_ENV] = str(self.attempts.cause_file)
        # its own session: a Ctrl-C reaches the launcher alone, which stops the children in order
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True, preexec_fn=parent_death.preexec())
        self.proc_started = process_table.started(self.proc.pid) or 0
        self.started_at = time.time()

    def given_up(self) -> bool:
        return self.attempts is not None and self.attempts.given_up

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def record(self) -> launch_record.ChildRecord:
        return launch_record.ChildRecord(self.name, self.pid() or 0, self.proc_started, self.queue or "")


def plan_children(config_path: str, config: ServerConfig, only: str | None, only_name: str | None,
                  replicas: list[int] | None = None) -> list[Child]:
    """The children of a launch; `replicas` picks the replicas of the `only_name` pool (default: all)."""
    py = sys.executable
    children: list[Child] = []
    if only in (None, "api"):
        listen = config.http_options
        children.append(Child("api", [py, "-m", "api", "-c", config_path, "--host", listen.host,
                                      "--port", str(listen.port)]))
    if only in (None, "worker"):
        for app in config.model_apps():
            if only_name and app.name != only_name:
                continue
            for replica in replica_choice.chosen(app, replicas):
                children.append(Child(f"worker {app.name}#{replica}", [py, "-m", "workers", "-c", config_path,
                                      "--app", app.name, "--replica", str(replica)],
                                      queue=model_queue(app.name, replica), env=_app_env(app)))
        for sampler in config.sampler_apps():
            if only_name and sampler.name != only_name:
                continue
            children.append(Child(f"worker {sampler.name}", [py, "-m", "workers", "-c", config_path, "--app",
                                                             sampler.name],
                                  queue=sampler_queue(sampler.name), env=_app_env(sampler)))
        for processor in config.processor_apps():
            if only_name and processor.name != only_name:
                continue
            children.append(Child(f"worker {processor.name}", [py, "-m", "workers", "-c", config_path, "--app",
                                                               processor.name],
                                  queue=processor_queue(processor.name), env=_app_env(processor)))
    if only == "flower" or (only is None and config.flower.enabled):
        children.append(Child("flower", [py, "-m", "twinkle.server.flower", "-c", config_path]))
    return children


def _app_env(app: Application) -> dict[str, str]:
    env: dict[str, str] = {}
    if isinstance(app, ModelApp | SamplerApp) and is_mock(app.args):
        # the mock's small matrices run slower with BLAS threads fighting the API for the cores
        env["OPENBLAS_NUM_THREADS"] = os.environ.get("OPENBLAS_NUM_THREADS", "1")
    for deployment in app.deployments or []:
        if deployment.runtime_env is not None:
            env.update({k: str(v) for k, v in (deployment.runtime_env.env_vars or {}).items()})
    return env


class Supervisor:
    def __init__(self, children: list[Child], r: redis.Redis, keys: Keys,
                 on_start: Callable[[], None] = lambda: None) -> None:
        self.children = children
        self.r = r
        self.keys = keys
        self.on_start = on_start  # called after children started: the launch record names every child
        self.stopping = False
        self.hangs = HangWatch(r, keys)
        liveness_dir = Path(tempfile.mkdtemp(prefix="twinkle-liveness-"))
        for i, child in enumerate(children):
            if child.queue:
                child.liveness_file = str(liveness_dir / f"pool-{i}.json")
            if child.queue or child.name == "api":
                child.attempts = StartAttempts(liveness_dir / f"start-failure-{i}.txt")

    def start_all(self) -> None:
        for child in self.children:
            if child.queue:
                restore_if_vacant(self.r, self.keys, child.queue)  # never another live worker's messages
            child.start()
        self.on_start()

    def check(self) -> None:
        for child in self.children:
            if not self.stopping and child.alive():
                self._watch(child)  # a hung worker is killed here, and restarted below
            if self.stopping or child.alive() or child.given_up():
                continue
            pause = None
            if not child.awaiting_broker:
                code = child.proc.returncode if child.proc else None
                pause = _start_failed(child, code)
                if pause is None:
                    why = f" ({exit_reason(code)})" if exit_reason(code) else ""
                    log.error("%s exited with code %s%s; restarting it", child.name, code, why)
                    print(f"[twinkle] {child.name} exited with code {code}{why}; restarting", flush=True)
                _kill_leftovers(child)
            if child.queue and not self._restore(child):
                continue  # the broker is away: restart once it answers, never before the unacked are back
            if child.given_up():
                continue
            child.restarts += 1
            if pause is not None:
                time.sleep(pause)  # it failed to start: give a passing cause (a busy device) time to clear
            elif time.time() - child.started_at < 2:
                time.sleep(min(10, child.restarts))  # crash loop: back off instead of spinning
            child.start()
            self.on_start()

    def _restore(self, child: Child) -> bool:
        """Put the dead worker's unacked messages back; False while the broker is unreachable (transient: a
        Redis restart or outage must not stop the launcher, which would stop every pool)."""
        assert child.queue is not None
        try:
            restored = restore_if_vacant(self.r, self.keys, child.queue)
        except redis.RedisError as exc:
            if not child.awaiting_broker:
                log.warning("cannot restore %s while the broker is unreachable (%s); retrying", child.queue, exc)
                print(f"[twinkle] broker unreachable: {child.name} restarts once it is back", flush=True)
            child.awaiting_broker = True
            return False
        child.awaiting_broker = False
        if restored:
            log.warning("put %d unacked message(s) back at the head of %s", restored, child.queue)
        return True

    def _watch(self, child: Child) -> None:
        """Kill a pool worker that froze (its own watchdog cannot act), failing the op it was running."""
        if not child.liveness_file or child.proc is None:
            return
        beat = liveness.read(child.liveness_file)
        if beat is None or beat.pid != child.proc.pid:
            return  # not written yet by this process (still loading its model)
        why = self.hangs.verdict(beat, queue=child.queue or "", since=child.started_at)
        if not why:
            return
        log.error("%s hung (%s); killing it", child.name, why)
        print(f"[twinkle] {child.name} hung ({why}); killing it", flush=True)
        try:
            self.hangs.fail_current(beat, why, child.queue or "")
        except redis.RedisError:  # the restarted worker fails it as lost when it is redelivered
            log.warning("could not fail %s of hung %s: the broker is unreachable", beat.current, child.name)
        _kill_leftovers(child)
        child.proc.wait()

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
        for child in self.children:
            _kill_leftovers(child)  # what a stopped child started and left behind (Ray's agents, its actors)


def _start_failed(child: Child, code: int | None) -> float | None:
    """For a child that died before it was ready: say why in one line, and return the pause before its next
    try (0 or more), or give up on it. None for a child that had been ready (an ordinary crash)."""
    attempts = child.attempts
    if attempts is None or attempts.ready:
        return None
    cause = attempts.cause(code)
    pause = attempts.failed()
    if pause is None:
        print(f"[twinkle] ERROR: {child.name} failed to start {startup.START_ATTEMPTS} times; giving up: {cause}",
              flush=True)
        return 0.0
    print(f"[twinkle] {child.name} failed to start (try {attempts.failures} of {startup.START_ATTEMPTS}): "
          f"{cause}; retrying in {pause:.0f} s", flush=True)
    return pause


def _kill_leftovers(child: Child) -> None:
    """Kill what a dead worker left in its session (a private Ray instance's agents and actors outlive it)."""
    if child.proc is not None:
        leftovers.kill_session(child.proc.pid, child.proc_started)


def wait_until_ready(sup: Supervisor, readiness: Readiness, stop: dict[str, bool],
                     status: PoolStatusPrinter | None = None) -> str | None:
    """Print where the API listens and each pool as it becomes ready; None once every child is ready, else why
    not (a child the supervisor gave up on, or a stop request)."""
    probed = [child for child in sup.children if child.attempts is not None]
    slow_at = time.time() + READY_TIMEOUT_SECONDS
    while not stop["requested"]:
        sup.check()
        failed = [child.name for child in probed if child.given_up()]
        if failed:
            return f"{', '.join(failed)} failed to start"
        for line in readiness.poll(probed):
            print(f"[twinkle] {line}", flush=True)
        waiting = [child.name for child in probed if not child.attempts.ready]  # type: ignore[union-attr]
        if not waiting:
            return None
        if time.time() > slow_at:  # a large model may still be downloading: say so once, keep waiting
            print(f"[twinkle] still waiting after {READY_TIMEOUT_SECONDS:.0f} s for {', '.join(waiting)}",
                  flush=True)
            slow_at = float("inf")
        if status is not None:
            status.maybe_print(sup.children)
        time.sleep(0.1)
    return "stopped"


def launch(config_path: str, config: ServerConfig, only: str | None = None, only_name: str | None = None,
           namespace: str = "twinkle_cluster", verbose: bool = False, replicas: list[int] | None = None) -> int:
    """Run the launch until it is stopped; `config.http_options` is where the API listens (the CLI's --host and
    --port already applied) and `replicas` the replicas of the `only_name` pool to start (default: all)."""
    children_env = verbosity.children_env(verbose)
    logging.basicConfig(level=children_env[verbosity.LEVEL_ENV],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls
    config_path = str(Path(config_path).resolve())
    url = os.environ.get("TWINKLE_BROKER_URL") or config.broker.url
    if not url and only is not None:
        print("--only needs a shared broker: set broker.url in the config.", file=sys.stderr)
        return 2
    children = plan_children(config_path, config, only, only_name, replicas)
    mine = _record_of(config_path, config, only, only_name, replicas, url or "", children)
    for line in leftovers.clear_predecessors(mine):  # before the port check: a leftover API may hold the port
        print(f"[twinkle] {line}", flush=True)
    if only in (None, "api"):
        taken = port_taken(config.http_options.host, config.http_options.port)
        if taken:
            print(f"[twinkle] ERROR: {taken}", file=sys.stderr, flush=True)
            return 1
    os.environ.update(children_env)
    broker: EmbeddedBroker | None = None
    if not url:
        broker = EmbeddedBroker()
        url = broker.start()
        print(f"[twinkle] embedded Valkey broker at {url}", flush=True)
    broker_child = (launch_record.ChildRecord("broker", broker.proc.pid, process_table.started(broker.proc.pid) or 0)
                    if broker is not None and broker.proc is not None else None)

    def write_record() -> None:
        started = [child.record() for child in children if child.proc is not None]
        launch_record.write(replace(mine, broker_url=url, children=tuple(filter(None, [broker_child, *started]))))

    write_record()  # `clear persistence` finds the embedded broker through it
    record = launch_record.record_path(mine.name)
    guard = reaper.start(record)
    os.environ["TWINKLE_BROKER_URL"] = url
    os.environ["TWINKLE_RAY_NAMESPACE"] = namespace
    r = redis.Redis.from_url(url)
    keys = Keys(config.persistence.key_prefix)
    if not config.auth.api_keys and not config.auth.keys_file:
        print("[twinkle] WARNING: no API keys configured - DEV MODE: any key is accepted and each distinct "
              "key is its own tenant. Configure auth.api_keys or auth.keys_file for shared servers.", flush=True)
        os.environ[DEV_MODE_SAID_ENV] = "1"
    snapshot_path = config.persistence.file_path if config.persistence.mode == "file" and only is None else None
    if snapshot_path:
        print(f"[twinkle] restored {restore_snapshot(r, snapshot_path)} durable records from {snapshot_path}",
              flush=True)
    instance = new_instance_id()
    sup = Supervisor(children, r, keys, on_start=write_record)
    for child in sup.children:
        if child.name == "api":
            child.env[INSTANCE_ENV] = instance
    readiness = Readiness(config, r, keys, instance)
    status = PoolStatusPrinter(r, keys)
    stop = {"requested": False}

    def _on_signal(signum: int, _frame: Any) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    started = time.time()
    try:
        sup.start_all()
        not_ready = wait_until_ready(sup, readiness, stop, status)
        if not_ready is not None and not stop["requested"]:
            print(f"[twinkle] ERROR: not ready: {not_ready}; stopping", file=sys.stderr, flush=True)
            return 1
        if not_ready is None:
            print(f"[twinkle] ready in {time.time() - started:.1f} s; Ctrl-C to stop", flush=True)
        last_snapshot = time.time()
        while not stop["requested"]:
            sup.check()
            for line in readiness.poll(sup.children):  # a restarted child is back
                print(f"[twinkle] {line}", flush=True)
            status.maybe_print(sup.children)
            if snapshot_path and time.time() - last_snapshot > SNAPSHOT_SECONDS:
                try:
                    save_snapshot(r, keys, snapshot_path)
                except redis.RedisError:  # the broker is away: keep the last snapshot, try again later
                    log.warning("snapshot skipped: the broker is unreachable")
                last_snapshot = time.time()
            time.sleep(0.2)
    finally:
        print("[twinkle] stopping", flush=True)
        sup.stop_all()
        if snapshot_path:
            save_snapshot(r, keys, snapshot_path)
        if broker is not None:
            broker.stop()
        launch_record.remove(record)
        reaper.stop(guard)
    return 0


def _record_of(config_path: str, config: ServerConfig, only: str | None, only_name: str | None,
               replicas: list[int] | None, url: str, children: list[Child]) -> launch_record.LaunchRecord:
    """This launch's record before any child runs: what it will run, for finding the predecessors it replaces."""
    api = only in (None, "api")
    pool = next((app for app in config.applications if app.name == only_name), None)
    name = launch_record.record_name(config_path, only, only_name,
                                     replica_choice.chosen(pool, replicas) if pool is not None else [],
                                     config.http_options.port, config.flower.port)
    return launch_record.LaunchRecord(os.getpid(), config.http_options.port if api else 0, url, config_path,
                                      process_table.started(os.getpid()) or 0, name,
                                      tuple(child.record() for child in children), process_table.node())
