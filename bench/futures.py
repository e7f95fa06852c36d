"""Futures round trips on the mock backend: what the server itself costs per op.

    python bench/futures.py [--steps 500] [--skip-sdk]

Launches `twinkle-server launch` on an embedded broker with the mock backend on the tiny model and
prints: seconds from launch to ready; summed PSS of all server processes at idle; the sequential step
round trip (submit forward_backward + optim_step, wait both) p50/p90/p99; ops/s through one model pool
with 1, 4 and 16 concurrent clients; sample latency (16 tokens) p50/p99; API memory while 2,000
long-polls are pending; and the same step through the real Tinker SDK.
Targets on a 2-core machine: step p50 <= 15 ms, pool >= 200 ops/s, sample p50 <= 15 ms,
2,000 pending long-polls < 100 MB added, ready <= 10 s, idle <= 1 GB PSS, SDK step p50 <= 25 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from raw_client import BenchServer, Client, one_pool_config, pct, run_concurrently

from tests.harness import free_port
from twinkle.tiny_model import ensure_tiny_model


def summary(name: str, ms: list[float]) -> None:
    print(f"{name:<44} p50 {pct(ms, 50):7.2f} ms   p90 {pct(ms, 90):7.2f} ms   p99 {pct(ms, 99):7.2f} ms"
          f"   (n={len(ms)})")


def pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        m = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
        total += int(m.group(1)) if m else 0
    return total / 1024


class Server(BenchServer):
    def __init__(self, workdir: Path, model_dir: Path) -> None:
        super().__init__(workdir, "bench", one_pool_config(workdir, model_dir, free_port()),
                         env={"TWINKLE_LOG_LEVEL": os.environ.get("TWINKLE_LOG_LEVEL", "WARNING")})

    def pids(self) -> list[int]:
        parent = psutil.Process(self.proc.pid)
        return [parent.pid] + [c.pid for c in parent.children(recursive=True)]

    def worker_pid(self) -> int:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "workers" in child.cmdline():
                return int(child.pid)
        raise RuntimeError("no worker process")


def bench_steps(api: str, steps: int) -> None:
    client = Client(api, "bench-steps")
    for _ in range(30):
        client.step()
    ms = []
    for _ in range(steps):
        t = time.perf_counter()
        client.step()
        ms.append((time.perf_counter() - t) * 1000)
    summary("step round trip (fb + optim, raw HTTP)", ms)


def bench_throughput(api: str, clients: int, seconds: float = 5.0) -> None:
    pool = [Client(api, f"bench-tp-{clients}-{i}") for i in range(clients)]
    counts = [0] * clients
    stop = time.perf_counter() + seconds

    def run(i: int) -> None:
        while time.perf_counter() < stop:
            pool[i].op()
            counts[i] += 1

    elapsed = run_concurrently(run, clients)
    rate = sum(counts) / elapsed
    print(f"one model pool, {clients:>2} concurrent clients{'':<17} {rate:7.1f} ops/s (forward_backward, 32 tokens)")


def bench_sample(api: str, n: int = 200) -> None:
    client = Client(api, "bench-sample")
    body = {"base_model": "tiny-qwen", "num_samples": 1, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [5, 6, 7, 8]}]}, "sampling_params": {"max_tokens": 16, "temperature": 1.0}}
    ms = []
    for i in range(n + 20):
        t = time.perf_counter()
        client.wait(client.c.post("/asample", json=body).json()["request_id"])
        if i >= 20:
            ms.append((time.perf_counter() - t) * 1000)
    summary("sample, 16 tokens", ms)


async def _hold_polls(api: str, rids: list[str], key: str) -> None:
    limits = httpx.Limits(max_connections=len(rids) + 10, max_keepalive_connections=len(rids) + 10)
    async with httpx.AsyncClient(base_url=api, headers={"X-API-Key": key}, timeout=120, limits=limits) as c:
        await asyncio.gather(*(c.post("/retrieve_future", json={"request_id": rid}) for rid in rids))


def bench_pending_polls(server: Server, n: int = 2000) -> None:
    client = Client(server.api, "bench-polls")
    api = server.api_process()
    before = api.memory_info().rss / 2**20
    worker = psutil.Process(server.worker_pid())
    worker.suspend()  # ops stay queued: every long-poll below stays pending
    try:
        rids = [client.c.post("/forward_backward", json=client.fb).json()["request_id"] for _ in range(n)]
        thread = threading.Thread(target=asyncio.run, args=(_hold_polls(server.api, rids, "bench-polls"),))
        thread.start()
        time.sleep(8)
        during = api.memory_info().rss / 2**20
    finally:
        worker.resume()
    thread.join()
    print(f"API RSS with {n} pending long-polls{'':<14} {during:7.1f} MB (idle {before:.1f} MB, "
          f"+{during - before:.1f} MB)")


def bench_sdk(base_url: str, steps: int) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench-sdk")
    tc = service.create_lora_training_client(base_model="tiny-qwen", rank=8).result()
    tokens = [(7 * i) % 400 + 3 for i in range(33)]
    batch = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32})]
    ms = []
    for i in range(steps + 30):
        t = time.perf_counter()
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result()
        opt.result()
        if i >= 30:
            ms.append((time.perf_counter() - t) * 1000)
    summary("step round trip through the Tinker SDK", ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--skip-sdk", action="store_true")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = ensure_tiny_model(work / "tiny-qwen")
        server = Server(work, model)
        ready = server.start()
        try:
            print(f"{'launch to ready':<44} {ready:7.2f} s")
            time.sleep(2)
            print(f"{'summed PSS of all server processes at idle':<44} {pss_mb(server.pids()):7.1f} MB "
                  f"({len(server.pids())} processes)")
            bench_steps(server.api, ns.steps)
            for n in (1, 4, 16):
                bench_throughput(server.api, n)
            bench_sample(server.api)
            bench_pending_polls(server)
            if not ns.skip_sdk:
                bench_sdk(f"http://127.0.0.1:{server.port}", ns.steps)
        finally:
            server.stop()
    print(json.dumps({"note": "2-core machine; client, API, worker and broker share the cores"}))


if __name__ == "__main__":
    main()
