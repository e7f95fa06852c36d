"""Faults and load injected for real: Redis outages, thousands of pending long-polls, an abusive tenant.

    python bench/faults.py [--quick] [--outages 3,5,10] [--polls 10000] [--seconds 20] [--skip-load] [--only polls]
    python bench/faults.py --frozen-backlog 2000

Launches `twinkle-server launch` (mock backend, tiny model) on a redis-server of its own (`appendonly yes`, a
free port; needs `redis-server` on PATH) and prints:

1. Redis outages: for each outage length, the seconds from Redis answering again until a new op is accepted
   and completed (target <= 2 s); and over all outages, the futures submitted just before them (one running,
   several queued per outage): how many ended completed, failed (by code), or never terminal (lost).
2. Pending long-polls: `--polls` retrieve_future polls held open at once on one API process while training
   clients step; the clients' step p50/p99 with the polls parked vs without (target p99 <= 2x), the API's
   added memory, and how the polls ended once their futures finished (200 / try_again / errors / timeouts /
   non-2xx). Next to it the memory a bare uvicorn app (no framework, no Redis: it parks every request) adds to
   hold the same number of requests, the floor under any long-poll served by this HTTP server, and the API's
   figure as a multiple of it (target <= 2x; bench/poll_memory.py shows where it goes).
3. Abusive tenant: bench/load.py's alternating windows, short (`--skip-load` leaves it out); its p99 ratio.
4. `--frozen-backlog N` (run alone, on a server of its own with two pool replicas): N ops of one adapter queued
   behind a pool worker frozen (SIGSTOP) right after it began an op, until the launcher replaces it (its op's
   record is past execution_timeout): the seconds until all N long-polls answered (the adapter died with the
   worker: adapter_state_lost), and the step p50/p99 of other tenants training on the other replica before and
   during, with error/timeout/non-2xx counts.

5. `--flapping N` (run alone): a broker (appendonly) killed and restarted N times, 1-3 s apart, each time down
   0.2-1 s, while a tenant trains with seq_ids as the Tinker SDK sends them: ops submitted, completed, failed
   (by code), never terminal; ops the pool ran (its model's `ops_executed`) against ops submitted (any
   difference is an op run twice or lost); whether the worker kept its pid; op p50/p99 and the longest.
6. `--two-consumers` (run alone): while a pool's worker trains a tenant, two more `launch --only worker` of the
   same pool start at once (the race for the queue): how each ended and the line it printed; the tenant's ops
   meanwhile. Then the first launcher is SIGKILLed and a new one started at once: the seconds until it is ready
   and a new adapter trained, the consumer's pid, and how the old adapter's next op ended.

`--quick`: one 3 s outage, 2,000 polls, 8 s per phase. `--only outages|polls|load`: that phase alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from raw_client import BenchServer, Client, datum, one_pool_config, pct, run_concurrently

from tests.harness import free_port
from tests.private_redis import PrivateRedis
from twinkle import blobs
from twinkle.auth import tenant_id
from twinkle.fd_limit import raise_open_files_limit
from twinkle.futures import FutureRecord, new_request_id
from twinkle.keys import Keys
from twinkle.tiny_model import ensure_tiny_model

KEYS = Keys("")
POLL_KEY = "bench-polls"


class Server(BenchServer):
    def __init__(self, workdir: Path, model_dir: Path, broker: PrivateRedis) -> None:
        config = {**one_pool_config(workdir, model_dir, free_port()), "broker": {"url": broker.url}}
        # polls stay parked through the measurement (a 30 s long-poll would answer try_again midway)
        super().__init__(workdir, "faults", config, env={"TWINKLE_LONG_POLL_SECONDS": "180"})


# -- 1. outages ------------------------------------------------------------------------------------


def post_until_accepted(c: httpx.Client, path: str, body: dict[str, Any], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = c.post(path, json=body)
            if r.status_code == 200:
                return str(r.json()["request_id"])
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} not accepted within {timeout} s")
        time.sleep(0.05)


def outcome(c: httpx.Client, rid: str, timeout: float = 90) -> str:
    """'completed', 'failed:<code>', or 'never terminal' (bounded), riding out 503s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = c.post("/retrieve_future", json={"request_id": rid})
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        if r.status_code == 503:
            time.sleep(0.2)
            continue
        if r.status_code != 200:
            return f"http {r.status_code}"
        body = r.json()
        if body.get("type") == "try_again":
            continue
        return f"failed:{body.get('code')}" if "error" in body else "completed"
    return "never terminal"


def bench_outages(server: Server, broker: PrivateRedis, lengths: list[float]) -> None:
    client = Client(server.api, "bench-outage")
    c = client.c
    forward = {"model_id": client.model, "forward_input": {"data": [datum()], "loss_fn": "cross_entropy"}}
    slow = {"model_id": client.model, "forward_backward_input": {"data": [datum(2000)] * 16,
                                                                  "loss_fn": "cross_entropy"}}
    submitted: list[str] = []
    statuses: Counter[int] = Counter()
    for seconds in lengths:
        submitted.append(post_until_accepted(c, "/forward_backward", slow))  # running when Redis dies
        submitted += [post_until_accepted(c, "/forward", forward) for _ in range(4)]  # queued behind it
        time.sleep(0.2)
        broker.kill()
        down_until = time.monotonic() + seconds
        while time.monotonic() < down_until:  # what clients see meanwhile
            try:
                statuses[c.post("/retrieve_future", json={"request_id": submitted[-1]}, timeout=5).status_code] += 1
            except httpx.HTTPError:
                statuses[0] += 1
            time.sleep(0.25)
        broker.start()
        back = time.monotonic()
        rid = post_until_accepted(c, "/forward", forward)
        result = outcome(c, rid)
        print(f"outage {seconds:4.1f} s: first new op done {time.monotonic() - back:5.2f} s after Redis answered "
              f"({result}); server alive: {server.alive()}")
    ends = Counter(outcome(c, rid) for rid in submitted)
    lost = ends.get("never terminal", 0) + ends.get("failed:request_lost", 0)
    print(f"futures submitted just before the outages: {len(submitted)}; ended: "
          + ", ".join(f"{k} {v}" for k, v in sorted(ends.items())) + f"; lost {lost}")
    print("answers to retrieve_future while Redis was down: "
          + ", ".join(f"{'no answer' if k == 0 else k} x{v}" for k, v in sorted(statuses.items())))


# -- 2. pending long-polls -------------------------------------------------------------------------


def queued_futures(r: redis.Redis, n: int) -> list[str]:
    ids = [new_request_id() for _ in range(n)]
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        record = FutureRecord(request_id=rid, op="save_state", owner=tenant_id(POLL_KEY), model_id="",
                              queue="model.nobody.0", created_at=time.time())
        pipe.hset(KEYS.future(rid), mapping=record.to_hash())
    pipe.execute()
    return ids


def finish(r: redis.Redis, ids: list[str]) -> None:
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.set(KEYS.blob_out(rid), blobs.dumps({"path": f"tinker://bench/weights/{rid}"}))
        pipe.hset(KEYS.future(rid), "status", "completed")
        pipe.publish(KEYS.done_channel(rid), "completed")
    pipe.execute()


def poll_request(rid: str) -> bytes:
    body = json.dumps({"request_id": rid}).encode()
    return (b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: b\r\nX-API-Key: " + POLL_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


async def poll(port: int, rid: str) -> str:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(poll_request(rid))
        await writer.drain()
        raw = await reader.read()
        writer.close()
    except OSError as exc:
        return f"socket error ({type(exc).__name__})"
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = head.split()[1].decode() if head else "no answer"
    if status == "200" and b"try_again" in payload:
        return "200 try_again"
    return status


def hold_polls(port: int, ids: list[str], results: list[str], parked: threading.Event) -> None:
    async def main() -> None:
        calls = []
        for start in range(0, len(ids), 250):  # open them in waves: the accept queue is finite
            calls += [asyncio.create_task(poll(port, rid)) for rid in ids[start:start + 250]]
            await asyncio.sleep(0.25)
        parked.set()
        results.extend(await asyncio.gather(*calls))

    asyncio.run(main())


BARE_APP = """
import asyncio, sys, uvicorn
from twinkle.fd_limit import raise_open_files_limit
async def app(scope, receive, send):
    if scope["type"] == "http":
        await asyncio.Event().wait()
raise_open_files_limit()
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False, backlog=8192)
"""


def bare_server_floor(n: int) -> float:
    """MB that a bare uvicorn app adds while `n` requests like the polls are parked in it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", BARE_APP, str(port)], cwd=Path(__file__).resolve().parents[1])
    sockets: list[socket.socket] = []
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        server = psutil.Process(proc.pid)
        time.sleep(0.5)
        before = server.memory_info().rss
        request = poll_request(new_request_id())
        for i in range(n):
            sockets.append(socket.create_connection(("127.0.0.1", port)))
            sockets[-1].sendall(request)
            if i % 250 == 249:
                time.sleep(0.05)  # the accept queue is finite
        deadline = time.monotonic() + 60
        while established(server, port) < n and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1)
        return (server.memory_info().rss - before) / 2**20
    finally:
        for sock in sockets:
            sock.close()
        proc.kill()
        proc.wait()


def step_latencies(api: str, clients: int, seconds: float) -> list[float]:
    out: list[float] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        client = Client(api, f"bench-trainer-{i}")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            began = time.perf_counter()
            client.step()
            with lock:
                out.append((time.perf_counter() - began) * 1000)

    run_concurrently(run, clients)
    return out


def established(process: psutil.Process, port: int) -> int:
    return sum(1 for conn in process.net_connections("tcp") if conn.laddr and conn.laddr.port == port
               and conn.status == psutil.CONN_ESTABLISHED)


def bench_polls(server: Server, broker: PrivateRedis, n: int, seconds: float) -> None:
    raise_open_files_limit()
    r = redis.Redis.from_url(broker.url)
    api = server.api_process()
    baseline = step_latencies(server.api, 4, seconds)
    ids = queued_futures(r, n)
    before = api.memory_info().rss
    results: list[str] = []
    parked = threading.Event()
    holder = threading.Thread(target=hold_polls, args=(server.port, ids, results, parked), daemon=True)
    holder.start()
    parked.wait()
    deadline = time.monotonic() + 60
    held = established(api, server.port)
    while held < n and time.monotonic() < deadline:
        time.sleep(1)
        now_held = established(api, server.port)
        if now_held == held:
            break  # no more arriving
        held = now_held
    loaded = step_latencies(server.api, 4, seconds)
    during = api.memory_info().rss
    finish(r, ids)
    holder.join(timeout=120)
    ends = Counter(results)
    b99, l99 = pct(baseline, 99), pct(loaded, 99)
    added = (during - before) / 2**20
    print(f"pending long-polls held: {held} of {n}; API memory +{added:.0f} MB")
    print(f"training step p50 / p99 without polls {pct(baseline, 50):5.1f} / {b99:7.1f} ms (n={len(baseline)}), "
          f"with {held} parked polls {pct(loaded, 50):5.1f} / {l99:7.1f} ms (n={len(loaded)}): "
          f"p99 {l99 / b99:.2f}x (target <= 2x)")
    answered = ends["200"]
    errors = sum(v for k, v in ends.items() if k.startswith("socket error"))
    timeouts = n - len(results) + ends["no answer"]
    non_2xx = len(results) - answered - ends["200 try_again"] - errors - ends["no answer"]
    print("polls ended: " + ", ".join(f"{k} x{v}" for k, v in sorted(ends.items()))
          + f"; answered 200 {answered}, try_again {ends['200 try_again']}, errors {errors}, "
          f"timeouts {timeouts}, non-2xx {non_2xx}")
    floor = bare_server_floor(n)
    print(f"for scale: a bare uvicorn app holding {n} such requests adds {floor:.0f} MB; Twinkle's API "
          f"+{added:.0f} MB = {added / floor:.2f}x that floor (target <= 2x)")


# -- 3. abusive tenant -----------------------------------------------------------------------------


def bench_abuser(seconds: float) -> None:
    rounds = max(1, min(3, int(2 * seconds // 10)))  # windows of at least 5 s
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("load.py")), "--duration", str(2 * seconds),
                          "--rounds", str(rounds), "--clients", "10"], capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if re.search(r"p99 with|abusive client|refused", line)]
    for line in lines or [f"bench/load.py failed: {out.stderr[-500:]}"]:
        print(f"abusive tenant (bench/load.py, 10 clients): {line}")


# -- 4. a frozen worker's backlog ------------------------------------------------------------------

FROZEN_QUEUE, OTHER_QUEUE = "model.models-tiny.0", "model.models-tiny.1"


class FrozenBacklogServer(BenchServer):
    """Two replicas of the mock pool (the frozen one, and the other tenants' one), an execution_timeout."""

    def __init__(self, workdir: Path, model_dir: Path, broker: PrivateRedis, execution_timeout: float) -> None:
        config = {**one_pool_config(workdir, model_dir, free_port()), "broker": {"url": broker.url}}
        model = config["applications"][1]
        model["args"]["queue_config"] = {"execution_timeout": execution_timeout}
        model["deployments"] = [{"name": "ModelManagement",
                                 "autoscaling_config": {"min_replicas": 2, "max_replicas": 2}}]
        # the 2,000 polls stay parked until they are answered (a 30 s long-poll would answer try_again midway)
        super().__init__(workdir, "frozen-backlog", config, env={"TWINKLE_LONG_POLL_SECONDS": "180"})


def client_on(api: str, r: redis.Redis, queue: str, key: str) -> Client:
    """A client whose model landed on `queue` (new models go to the replica with the most free slots)."""
    for attempt in range(8):
        client = Client(api, f"{key}-{attempt}")
        if r.hget(KEYS.model(client.model), "queue") == queue.encode():
            return client
    raise RuntimeError(f"no model landed on {queue}")


def worker_of(r: redis.Redis, queue: str) -> int:
    raw = r.get(KEYS.pool_heartbeat(queue))
    return int(json.loads(raw)["pid"]) if raw else 0


class Trainer:
    """A tenant stepping (forward_backward + optim_step, both waited for) until stopped: each step's start,
    latency and whether it failed (a non-2xx, an error body, an exception or a timeout)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.steps: list[tuple[float, float, str]] = []  # (started, ms, "" or what went wrong)

    def run(self, stop: threading.Event) -> None:
        c = self.client.c
        while not stop.is_set():
            began, wrong = time.time(), ""
            try:
                for path, body in (("/forward_backward", self.client.fb),
                                   ("/optim_step", {"model_id": self.client.model, "adam_params": {}})):
                    r = c.post(path, json=body)
                    if r.status_code != 200:
                        wrong = f"http {r.status_code}"
                        break
                    answer = self.client.wait(r.json()["request_id"])
                    if "error" in answer:
                        wrong = f"error {answer.get('code')}"
                        break
            except httpx.TimeoutException:
                wrong = "timeout"
            except httpx.HTTPError as exc:
                wrong = f"exception {type(exc).__name__}"
            self.steps.append((began, (time.time() - began) * 1000, wrong))


def steps_between(trainers: list[Trainer], start: float, end: float) -> tuple[list[float], Counter[str]]:
    ms = [m for t in trainers for began, m, wrong in t.steps if start <= began < end and not wrong]
    wrong = Counter(w for t in trainers for began, _, w in t.steps if start <= began < end and w)
    return ms, wrong


async def submit_all(api: str, key: str, body: dict[str, Any], n: int) -> tuple[list[str], Counter[str]]:
    """`n` copies of an op submitted 16 at a time; the request ids and what went wrong."""
    ids: list[str] = []
    wrong: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=api, headers={"X-API-Key": key}, timeout=60) as c:
        async def one(_: int) -> None:
            try:
                r = await c.post("/forward_backward", json=body)
            except httpx.HTTPError as exc:
                wrong[type(exc).__name__] += 1
                return
            if r.status_code == 200:
                ids.append(r.json()["request_id"])
            else:
                wrong[f"http {r.status_code}"] += 1

        for start in range(0, n, 16):
            await asyncio.gather(*[one(i) for i in range(start, min(n, start + 16))])
    return ids, wrong


async def raw_poll(port: int, key: str, rid: str) -> tuple[str, float]:
    """Long-poll one future over a connection of its own until it ends: its outcome ("completed", the error
    code, "http N", "no answer" or the socket error) and when it came. Raw sockets: an HTTP client pool of
    thousands of connections costs the client more than the server."""
    body = json.dumps({"request_id": rid}).encode()
    request = (b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: b\r\nX-API-Key: " + key.encode()
               + b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            raw = await reader.read()
            writer.close()
        except OSError as exc:
            return f"socket error ({type(exc).__name__})", time.time()
        head, _, payload = raw.partition(b"\r\n\r\n")
        status = head.split()[1].decode() if head else "no answer"
        if status != "200":
            return f"http {status}" if head else status, time.time()
        answer = json.loads(payload)
        if answer.get("type") != "try_again":
            return (str(answer.get("code", "error")) if "error" in answer else "completed"), time.time()


def poll_all(port: int, key: str, ids: list[str], parked: Any, results: Any) -> None:
    """Long-poll every future at once (opened in waves: the accept queue is finite) until each ended; puts
    {request id: (outcome, when)} on `results`. Run in a process of its own (`polling`): answering thousands of
    polls at once would hold this process's interpreter while the other tenants' steps are timed."""
    raise_open_files_limit()

    async def main() -> None:
        calls = []
        for start in range(0, len(ids), 250):
            calls += [asyncio.create_task(raw_poll(port, key, rid)) for rid in ids[start:start + 250]]
            await asyncio.sleep(0.25)
        parked.set()
        results.put(dict(zip(ids, await asyncio.gather(*calls), strict=True)))

    asyncio.run(main())


def polling(port: int, key: str, ids: list[str]) -> tuple[Any, Any, Any]:
    """`poll_all` started in a new process: (the process, set once every poll is open, its results queue)."""
    context = multiprocessing.get_context("spawn")
    parked, results = context.Event(), context.Queue()
    process = context.Process(target=poll_all, args=(port, key, ids, parked, results), daemon=True)
    process.start()
    return process, parked, results


def bench_frozen_backlog(n: int = 2000, trainers: int = 4, baseline: float = 10.0,
                         execution_timeout: float = 5.0) -> None:
    """`n` ops of one adapter queued behind a pool worker that froze (SIGSTOP) right after it began an op, until
    the launcher replaces it; meanwhile other tenants train on the other replica. The launcher itself is paused
    while the ops are submitted and their long-polls parked (on a loaded machine that takes longer than its hang
    limits), so that all of them wait behind the frozen worker when it is replaced."""
    raise_open_files_limit()
    workdir = Path(tempfile.mkdtemp(prefix="twinkle-frozen-backlog-"))
    broker = PrivateRedis(workdir / "redis")
    broker.start()
    server = FrozenBacklogServer(workdir, ensure_tiny_model(workdir / "tiny-qwen"), broker, execution_timeout)
    server.start()
    r = redis.Redis.from_url(broker.url)
    stop = threading.Event()
    try:
        others = [Trainer(client_on(server.api, r, OTHER_QUEUE, f"bench-other-{i}")) for i in range(trainers)]
        victim = client_on(server.api, r, FROZEN_QUEUE, "bench-frozen")
        victim_key = str(victim.c.headers["X-API-Key"])
        threads = [threading.Thread(target=t.run, args=(stop,), daemon=True) for t in others]
        for thread in threads:
            thread.start()
        started = time.time()
        time.sleep(baseline)
        worker = worker_of(r, FROZEN_QUEUE)
        slow = {"model_id": victim.model, "forward_backward_input": {"data": [datum(2000)] * 16,
                                                                       "loss_fn": "cross_entropy"}}
        busy = victim.c.post("/forward_backward", json=slow).json()["request_id"]
        while r.hget(KEYS.future(busy), "status") != b"running":  # freeze it right after it began an op
            time.sleep(0.002)
        os.kill(worker, signal.SIGSTOP)
        frozen = time.time()
        os.kill(server.proc.pid, signal.SIGSTOP)  # the launcher: no hang verdict until the ops wait behind it
        try:
            ids, submit_wrong = asyncio.run(submit_all(server.api, victim_key, victim.fb, n))
            submitted = time.time()
            poller, parked, results = polling(server.port, victim_key, ids)
            parked.wait(120)
            time.sleep(1)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        resumed = time.time()
        while worker_of(r, FROZEN_QUEUE) in (0, worker) and time.time() - resumed < 120:
            time.sleep(0.05)
        replaced = time.time()
        assert broker.proc is not None
        processes = {"the API": server.api_process(), "the replacement": psutil.Process(worker_of(r, FROZEN_QUEUE)),
                     "the other replica": psutil.Process(worker_of(r, OTHER_QUEUE)),
                     "Redis": psutil.Process(broker.proc.pid)}
        cpu = {name: sum(process.cpu_times()[:2]) for name, process in processes.items()}
        try:
            ends: dict[str, tuple[str, float]] = results.get(timeout=240)
        except queue.Empty:
            ends = {}
        drained = time.time()
        cpu = {name: sum(process.cpu_times()[:2]) - cpu[name] for name, process in processes.items()}
        poller.join(timeout=10)
        answered = max((at for _, at in ends.values()), default=float("nan"))
        time.sleep(max(3.0, replaced + 60 - time.time()))  # the window the first report measured
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        stop.set()
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(worker, signal.SIGCONT)
        server.stop()
        broker.kill()
    outcomes = Counter(outcome for outcome, _ in ends.values())
    wrong = {k: v for k, v in outcomes.items() if k.startswith(("http", "no answer", "socket error"))}
    print(f"{len(ids)} ops of one adapter submitted behind a frozen worker in {submitted - frozen:.1f} s (refused: "
          f"{dict(submit_wrong) or 'none'}), their long-polls parked; the launcher, paused meanwhile, caught the "
          f"hang and had the replacement up {replaced - resumed:.1f} s after it resumed (execution_timeout "
          f"{execution_timeout:g} s)")
    print(f"their {len(ids)} long-polls: {len(ends)} answered, the last {answered - replaced:.2f} s after the "
          f"replacement was up ({answered - resumed:.1f} s after the launcher resumed); unanswered "
          f"{len(ids) - len(ends)}; "
          f"outcomes " + ", ".join(f"{k} x{v}" for k, v in sorted(outcomes.items()))
          + f"; non-2xx/timeouts/exceptions {sum(wrong.values())}")
    print(f"CPU seconds used from the replacement until all were answered ({drained - replaced:.1f} s; this "
          f"machine has {os.cpu_count()} cores): " + ", ".join(f"{name} {used:.2f}" for name, used in cpu.items()))
    windows = {"before": (started, frozen), "while the ops were submitted": (frozen, submitted),
               "from the replacement until all were answered (+3 s)": (replaced, answered + 3),
               "the 60 s after the replacement": (replaced, replaced + 60)}
    before = steps_between(others, started, frozen)[0]
    for name, (start, end) in windows.items():
        ms, failed = steps_between(others, start, end)
        why = f" {dict(failed)}" if failed else ""
        print(f"other tenants ({trainers} training on the other replica) {name}: step p50 / p99 {pct(ms, 50):.1f} / "
              f"{pct(ms, 99):.1f} ms (n={len(ms)}; failed {sum(failed.values())}{why}): p99 "
              f"{pct(ms, 99) / pct(before, 99):.2f}x before")


# -- 5. a flapping broker -------------------------------------------------------------------------------


def bench_flapping(flaps: int, seed: int = 23) -> None:
    import random

    workdir = Path(tempfile.mkdtemp(prefix="twinkle-flapping-"))
    broker = PrivateRedis(workdir / "redis", appendonly=True)
    broker.start()
    server = Server(workdir, ensure_tiny_model(workdir / "tiny-qwen"), broker)
    server.start()
    r = redis.Redis.from_url(broker.url)
    c = httpx.Client(base_url=server.api, headers={"X-API-Key": "bench-flapping"}, timeout=30)
    submitted: list[str] = []
    steps: list[float] = []
    stop = threading.Event()
    try:
        sid = c.post("/create_session", json={"tags": []}).json()["session_id"]
        created = post_until_accepted(c, "/create_model", {"session_id": sid, "base_model": "tiny-qwen",
                                                           "lora_config": {"rank": 8}})
        assert outcome(c, created) == "completed"
        model = r.hget(KEYS.future(created), "model_id").decode()  # type: ignore[union-attr]
        worker = worker_of(r, "model.models-tiny.0")

        def train() -> None:
            seq = 0
            while not stop.is_set():
                began = time.monotonic()
                seq += 1
                fb = {"data": [datum()], "loss_fn": "cross_entropy"}
                body: dict[str, Any] = ({"model_id": model, "seq_id": seq, "adam_params": {"learning_rate": 0.01}}
                                        if seq % 2 == 0 else
                                        {"model_id": model, "seq_id": seq, "forward_backward_input": fb})
                rid = post_until_accepted(c, "/optim_step" if seq % 2 == 0 else "/forward_backward", body)
                submitted.append(rid)
                outcome(c, rid)
                steps.append((time.monotonic() - began) * 1000)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        pace = random.Random(seed)
        began = time.time()
        for _ in range(flaps):
            time.sleep(pace.uniform(1, 3))
            broker.outage(pace.uniform(0.2, 1.0))
        time.sleep(3)
        stop.set()
        trainer.join(timeout=120)
        flapped = time.time() - began
        outcomes = Counter(outcome(c, rid) for rid in submitted)
        executed = int(r.hget(KEYS.model(model), "ops_executed") or 0) - 1  # less its create
        kept = worker_of(r, "model.models-tiny.0") == worker and server.alive()
    finally:
        stop.set()
        server.stop()
        broker.kill()
    print(f"flapping broker: {flaps} restarts over {flapped:.0f} s; {len(submitted)} ops submitted, outcomes "
          + ", ".join(f"{k} x{v}" for k, v in sorted(outcomes.items()))
          + f"; the pool ran {executed} of them (run twice or lost: {abs(executed - len(submitted))}); "
          f"worker kept its pid: {kept}")
    print(f"flapping broker: op p50 / p99 / max {pct(steps, 50):.0f} / {pct(steps, 99):.0f} / {max(steps):.0f} ms "
          f"(riding out the restarts; n={len(steps)})")


# -- 6. two consumers of one queue ------------------------------------------------------------------------


def bench_two_consumers() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="twinkle-two-consumers-"))
    broker = PrivateRedis(workdir / "redis", appendonly=True)
    broker.start()
    server = Server(workdir, ensure_tiny_model(workdir / "tiny-qwen"), broker)
    server.start()
    r = redis.Redis.from_url(broker.url)
    queue_name = "model.models-tiny.0"
    extra: list[subprocess.Popen[bytes]] = []
    replacement: BenchServer | None = None
    try:
        tenant = Client(server.api, "bench-two-consumers")
        first = worker_of(r, queue_name)
        for _ in range(3):
            tenant.step()
        # a second launcher on this machine, and two bare workers as other nodes would start them, all at once
        commands = {"a second `launch --only worker` here": ["twinkle.server", "launch", "--only", "worker",
                                                             "models-tiny", "-c", str(server.cfg_path)],
                    "a worker as on another node": ["workers", "-c", str(server.cfg_path), "--app", "models-tiny"],
                    "another worker as on a third node": ["workers", "-c", str(server.cfg_path), "--app",
                                                          "models-tiny"]}
        logs = [workdir / f"second-{i}.log" for i in range(len(commands))]
        began = time.monotonic()
        extra = [subprocess.Popen([sys.executable, "-m", *command], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                  env=dict(os.environ, TWINKLE_BROKER_URL=broker.url), start_new_session=True)
                 for command, log in zip(commands.values(), logs, strict=True)]
        during: Counter[str] = Counter()
        while any(p.poll() is None for p in extra) and time.monotonic() - began < 120:
            body = tenant.wait(tenant.c.post("/forward_backward", json=tenant.fb).json()["request_id"])
            during["failed:" + str(body.get("code")) if "error" in body else "completed"] += 1
        for name, p, log in zip(commands, extra, logs, strict=True):
            line = next((x for x in log.read_text().splitlines() if re.search("lease|holds|already runs", x)), "?")
            print(f"two consumers: {name} exited {p.poll()} ({time.monotonic() - began:.1f} s at the latest): "
                  f"{line.strip()[:240]}")
        print("two consumers: the tenant's ops meanwhile: " + ", ".join(f"{k} x{v}" for k, v in sorted(during.items()))
              + f"; consumer pid unchanged: {worker_of(r, queue_name) == first}")

        os.kill(server.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        replacement = BenchServer(workdir, "replacement", yaml_config(server.cfg_path), env={})
        startup = replacement.start()
        fresh = Client(replacement.api, "bench-two-consumers-new")
        fresh.step()
        trained = time.monotonic() - killed
        tenant.c = httpx.Client(base_url=replacement.api, headers={"X-API-Key": "bench-two-consumers"}, timeout=60)
        lost = tenant.wait(tenant.c.post("/forward_backward", json=tenant.fb).json()["request_id"])
        print(f"two consumers: SIGKILL of the first launcher, a new one started at once: ready in {startup:.1f} s, "
              f"a new adapter trained {trained:.1f} s after the kill; consumer now pid {worker_of(r, queue_name)} "
              f"(was {first}); the old adapter's next op: {lost.get('code', 'completed')}: {lost.get('error', '')}")
    finally:
        for p in extra:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        if replacement is not None:
            replacement.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        broker.kill()


def yaml_config(path: Path) -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load(path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--outages", default="3,5,10", help="outage lengths in seconds")
    parser.add_argument("--polls", type=int, default=10000)
    parser.add_argument("--seconds", type=float, default=20, help="length of each measured phase")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--only", choices=["outages", "polls", "load"], help="run this phase alone")
    parser.add_argument("--frozen-backlog", type=int, metavar="N", default=0,
                        help="run only phase 4 with N ops (2000 in the README)")
    parser.add_argument("--flapping", type=int, metavar="N", default=0, help="run only phase 5 with N restarts")
    parser.add_argument("--two-consumers", action="store_true", help="run only phase 6")
    ns = parser.parse_args()
    if ns.flapping:
        bench_flapping(ns.flapping)
        return
    if ns.two_consumers:
        bench_two_consumers()
        return
    if ns.frozen_backlog:
        bench_frozen_backlog(ns.frozen_backlog)
        return
    if ns.quick:
        ns.outages, ns.polls, ns.seconds = "3", 2000, 8
    def wanted(phase: str) -> bool:
        return ns.only in (None, phase)

    workdir = Path(tempfile.mkdtemp(prefix="twinkle-faults-"))
    broker = PrivateRedis(workdir / "redis", appendonly=True)
    broker.start()
    server = Server(workdir, ensure_tiny_model(workdir / "tiny-qwen"), broker)
    server.start()
    try:
        if wanted("outages"):
            bench_outages(server, broker, [float(x) for x in ns.outages.split(",")])
        if wanted("polls"):
            bench_polls(server, broker, ns.polls, ns.seconds)
    finally:
        server.stop()
        broker.kill()
    if wanted("load") and not ns.skip_load:
        bench_abuser(ns.seconds)
    print("note: clients, API, workers and Redis share this machine's cores")


if __name__ == "__main__":
    main()
