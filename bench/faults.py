"""Faults and load injected for real: Redis outages, thousands of pending long-polls, an abusive tenant.

    python bench/faults.py [--quick] [--outages 3,5,10] [--polls 10000] [--seconds 20] [--skip-load]

Launches `twinkle-server launch` (mock backend, tiny model) on a redis-server of its own (`appendonly yes`, a
free port; needs `redis-server` on PATH) and prints:

1. Redis outages: for each outage length, the seconds from Redis answering again until a new op is accepted
   and completed (target <= 2 s); and over all outages, the futures submitted just before them (one running,
   several queued per outage): how many ended completed, failed (by code), or never terminal (lost).
2. Pending long-polls: `--polls` retrieve_future polls held open at once on one API process while training
   clients step; the clients' step p99 with the polls parked vs without (target <= 2x), the API's added
   memory (target < 100 MB), and how the polls ended once their futures finished (200 / 503 / try_again).
   For scale, the memory a bare uvicorn app (no framework, no Redis: it parks every request) adds to hold
   the same number of requests: the floor under any long-poll served by this HTTP server.
3. Abusive tenant: bench/load.py's alternating windows, short (`--skip-load` leaves it out); its p99 ratio.

`--quick`: one 3 s outage, 2,000 polls, 8 s per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
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
    print(f"pending long-polls held: {held} of {n}; API memory +{(during - before) / 2**20:.0f} MB")
    print(f"training step p99 without polls {b99:7.1f} ms (n={len(baseline)}), with {held} parked polls "
          f"{l99:7.1f} ms (n={len(loaded)}): {l99 / b99:.2f}x (target <= 2x)")
    print("polls ended: " + ", ".join(f"{k} x{v}" for k, v in sorted(ends.items()))
          + f"; unanswered {n - len(results)}")
    print(f"for scale: a bare uvicorn app holding {n} such requests adds {bare_server_floor(n):.0f} MB")


# -- 3. abusive tenant -----------------------------------------------------------------------------


def bench_abuser(seconds: float) -> None:
    rounds = max(1, min(3, int(2 * seconds // 10)))  # windows of at least 5 s
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("load.py")), "--duration", str(2 * seconds),
                          "--rounds", str(rounds), "--clients", "10"], capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if re.search(r"p99 with|abusive client|refused", line)]
    for line in lines or [f"bench/load.py failed: {out.stderr[-500:]}"]:
        print(f"abusive tenant (bench/load.py, 10 clients): {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--outages", default="3,5,10", help="outage lengths in seconds")
    parser.add_argument("--polls", type=int, default=10000)
    parser.add_argument("--seconds", type=float, default=20, help="length of each measured phase")
    parser.add_argument("--skip-load", action="store_true")
    ns = parser.parse_args()
    if ns.quick:
        ns.outages, ns.polls, ns.seconds = "3", 2000, 8
    workdir = Path(tempfile.mkdtemp(prefix="twinkle-faults-"))
    broker = PrivateRedis(workdir / "redis", appendonly=True)
    broker.start()
    server = Server(workdir, ensure_tiny_model(workdir / "tiny-qwen"), broker)
    server.start()
    try:
        bench_outages(server, broker, [float(x) for x in ns.outages.split(",")])
        bench_polls(server, broker, ns.polls, ns.seconds)
    finally:
        server.stop()
        broker.kill()
    if not ns.skip_load:
        bench_abuser(ns.seconds)
    print("note: clients, API, workers and Redis share this machine's cores")


if __name__ == "__main__":
    main()
