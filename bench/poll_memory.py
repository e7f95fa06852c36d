"""Where the memory of parked long-polls goes: one API app in this process, `--polls` retrieve_future
requests parked in it by a client process of their own.

    python bench/poll_memory.py [--polls 5000] [--trace] [--top 25] [--bare]

Prints the RSS the app added while they were parked, and with `--trace` the largest allocations that
appeared meanwhile (tracemalloc, grouped by the line that made them, then by type of live object); tracemalloc
itself costs memory, so compare RSS figures from runs without it. `--bare`: a bare ASGI app that parks every
request instead, the floor under any long-poll in this HTTP server (as bench/faults.py's `bare_server_floor`).
It needs no pool: the futures are queued on a queue nobody serves and stay parked; a private redis-server
holds them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import redis
import uvicorn
import uvloop
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import queued_futures
from raw_client import one_pool_config

from api.app import create_app
from tests.harness import free_port
from tests.private_redis import PrivateRedis
from twinkle.config import load_config
from twinkle.fd_limit import raise_open_files_limit
from twinkle.tiny_model import ensure_tiny_model

# The client: connects, sends one poll per request id read from stdin, holds the sockets until stdin closes.
CLIENT = """
import socket, sys, time
sys.path.insert(0, "bench")
from faults import poll_request
from twinkle.fd_limit import raise_open_files_limit
raise_open_files_limit()
port, ids = int(sys.argv[1]), sys.stdin.readline().split()
held = []
for i, rid in enumerate(ids):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(poll_request(rid))
    held.append(s)
    if i % 250 == 249:
        time.sleep(0.05)  # the accept queue is finite
print("sent", flush=True)
sys.stdin.read()
"""


async def parked_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await asyncio.Event().wait()


def connections(port: int) -> int:
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


async def measure(server: uvicorn.Server, port: int, ids: list[str], ns: argparse.Namespace,
                  pending: Any, broker: PrivateRedis) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    if not ns.bare:  # one request through every layer first: what the first request builds once is no poll's cost
        warm = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, str(port), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert warm.stdin and warm.stdout
        warm.stdin.write(ids[0].encode() + b"\n")
        await warm.stdin.drain()
        await warm.stdout.readline()
        while pending() < 1:
            await asyncio.sleep(0.05)
        warm.stdin.close()
        await warm.wait()
        await asyncio.sleep(1)
    gc.collect()
    me = psutil.Process()
    if ns.trace:
        tracemalloc.start(ns.depth)
    before_rss = me.memory_info().rss
    before_types = Counter(type(o).__name__ for o in gc.get_objects())
    before = tracemalloc.take_snapshot() if ns.trace else None
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, str(port), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert client.stdin and client.stdout
    client.stdin.write(" ".join(ids[1:]).encode() + b"\n")
    await client.stdin.drain()
    await client.stdout.readline()
    want = len(ids) - 1
    deadline = time.monotonic() + 120
    while pending() < want and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await asyncio.sleep(1)
    gc.collect()
    added = (me.memory_info().rss - before_rss) / 2**20
    print(f"{'bare app' if ns.bare else 'Twinkle API'}: {pending()} of {want} parked, "
          f"{connections(port)} connections; RSS +{added:.1f} MB = {added * 2**20 / max(1, want) / 1024:.1f} KB "
          f"per poll{' (tracemalloc on)' if ns.trace else ''}")
    if ns.trace and before is not None:
        after = tracemalloc.take_snapshot()
        stats = after.compare_to(before, "traceback")
        total = sum(s.size_diff for s in stats)
        print(f"tracemalloc: +{total / 2**20:.1f} MB traced ({total / max(1, want):.0f} B per poll)")
        for stat in stats[:ns.top]:
            print(f"\n{stat.size_diff / max(1, want):7.0f} B/poll {stat.count_diff / max(1, want):6.2f} blocks/poll")
            for line in stat.traceback.format(limit=ns.depth, most_recent_first=True)[:2 * ns.depth]:
                print("    " + line)
        after_types = Counter(type(o).__name__ for o in gc.get_objects())
        grown = sorted(((after_types[k] - before_types[k], k) for k in after_types), reverse=True)[:ns.top]
        print("\nlive objects (tracked by gc) per poll: "
              + ", ".join(f"{name} {count / max(1, want):.2f}" for count, name in grown if count > 0))
    client.stdin.close()
    await client.wait()
    broker.kill()
    sys.stdout.flush()
    os._exit(0)  # a graceful shutdown would wait for the parked requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--polls", type=int, default=5000)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--depth", type=int, default=8, help="frames kept per traced allocation")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--bare", action="store_true")
    ns = parser.parse_args()
    raise_open_files_limit()
    workdir = Path(tempfile.mkdtemp(prefix="twinkle-poll-memory-"))
    broker = PrivateRedis(workdir / "redis")
    broker.start()
    try:
        ids = queued_futures(redis.Redis.from_url(broker.url), ns.polls + 1)
        port = free_port()
        config = {**one_pool_config(workdir, ensure_tiny_model(workdir / "tiny-qwen"), port),
                  "broker": {"url": broker.url}}
        (workdir / "cfg.yaml").write_text(yaml.safe_dump(config))
        if ns.bare:
            app: Any = parked_app
            pending = lambda: connections(port)  # noqa: E731
        else:
            app = create_app(load_config(workdir / "cfg.yaml"), broker.url, long_poll_seconds=600)
            pending = lambda: app.state.ctx.hub.pending  # noqa: E731
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False, timeout_keep_alive=75, backlog=8192))

        async def run() -> None:
            await asyncio.gather(server.serve(), measure(server, port, ids, ns, pending, broker))

        uvloop.run(run())  # the loop uvicorn.run picks
    finally:
        broker.kill()


if __name__ == "__main__":
    main()
