"""Many tenants at once, and one abusing its rate limit: does the abuser hurt the others?

    python bench/load.py [--duration 60] [--clients 50] [--rps-limit 20] [--abusers-in-flight 16]
                         [--abuse optim|save] [--checkpoint-writes-per-key 2]

Launches `twinkle-server launch` (embedded broker, 127.0.0.1 only) with the mock backend on the tiny
model: one model pool and one sampler pool whose `queue_config` limits every API key to `--rps-limit`
requests/s. `--clients` well-behaved tenants (each its own key and model) loop over a mix of ops,
each waited to completion: forward_backward 40 %, optim_step 25 %, sample 25 %, retrieve of an old
result 10 %, with `--think-ms` between ops (and obeying Retry-After if they ever get a 429). The run has
two phases of `--duration`/2 seconds each: without, then with one abusive client that keeps
`--abusers-in-flight` requests outstanding at all times and ignores every 429: optim_steps, or with
`--abuse save` checkpoint saves (`save_weights`, the costliest op; `--checkpoint-writes-per-key 0` turns the
per-key cap on outstanding saves off, to see what it prevents). Printed: the well-behaved
clients' p50/p99 latency per phase and op, the ratio of the p99s (target: at most 2x), throughput,
and what the abuser got through.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from raw_client import BenchServer, datum, pct

from tests.harness import free_port
from twinkle.tiny_model import ensure_tiny_model

MIX: dict[str, float] = {"fb": 40, "optim": 25, "sample": 25, "retrieve": 10}
WARMUP_SECONDS = 3.0


SAMPLE = {"base_model": "tiny-qwen", "num_samples": 1, "prompt": {"chunks": [
    {"type": "encoded_text", "tokens": [5, 6, 7, 8]}]}, "sampling_params": {"max_tokens": 8, "temperature": 1.0}}


class Server(BenchServer):
    def __init__(self, workdir: Path, model_dir: Path, rps_limit: float, writes_per_key: int) -> None:
        limits = {"rps_limit": rps_limit, "window_seconds": 1}
        config = {
            "http_options": {"host": "127.0.0.1", "port": free_port()},
            "storage": {"checkpoint_dir": str(workdir / "ckpt"), "checkpoint_writes_per_key": writes_per_key},
            "applications": [
                {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}},
                {"name": "models-tiny", "route_prefix": "/api/v1/model/tiny", "import_path": "model",
                 "args": {"backend": "mock", "model_id": str(model_dir), "queue_config": limits,
                          "adapter_config": {"max_loras": 128}}},
                {"name": "sampler-tiny", "route_prefix": "/api/v1/sampler/tiny", "import_path": "sampler",
                 "args": {"model_id": str(model_dir), "sampler_type": "mock", "queue_config": limits}},
            ],
        }
        super().__init__(workdir, "load", config)


@dataclass
class Run:
    started: float
    phase_seconds: float
    latencies: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    abuser: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def phase(self, at: float) -> str | None:
        elapsed = at - self.started
        if elapsed < WARMUP_SECONDS or elapsed >= 2 * self.phase_seconds:
            return None
        if self.phase_seconds <= elapsed < self.phase_seconds + WARMUP_SECONDS:
            return None  # the abuser is ramping up: neither phase
        return "without" if elapsed < self.phase_seconds else "with"

    @property
    def over(self) -> bool:
        return time.monotonic() - self.started >= 2 * self.phase_seconds


class Tenant:
    def __init__(self, http: httpx.AsyncClient, key: str, run: Run, think: float) -> None:
        self.http = http
        self.headers = {"X-API-Key": key}
        self.run = run
        self.think = think
        self.model = ""
        self.done: list[str] = []

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        while True:
            r = await self.http.post(path, json=body, headers=self.headers)
            if r.status_code != 429:
                r.raise_for_status()
                result: dict[str, Any] = r.json()
                return result
            self.run.refused[path] += 1
            await asyncio.sleep(int(r.headers.get("retry-after-ms", "1000")) / 1000)

    async def wait(self, rid: str) -> dict[str, Any]:
        while True:
            body = await self.post("/retrieve_future", {"request_id": rid})
            if body.get("type") != "try_again":
                if "error" in body:
                    raise RuntimeError(body["error"])
                return body

    async def setup(self) -> None:
        sid = (await self.post("/create_session", {"tags": ["load"]}))["session_id"]
        created = await self.post("/create_model", {"session_id": sid, "base_model": "tiny-qwen",
                                                    "lora_config": {"rank": 4}})
        await self.wait(created["request_id"])
        self.model = created["model_id"]
        self.fb = {"model_id": self.model, "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"}}

    async def one(self, op: str) -> None:
        if op == "retrieve" and self.done:
            await self.post("/retrieve_future", {"request_id": random.choice(self.done)})
            return
        if op == "fb" or op == "retrieve":
            rid = (await self.post("/forward_backward", self.fb))["request_id"]
        elif op == "optim":
            rid = (await self.post("/optim_step", {"model_id": self.model, "adam_params": {}}))["request_id"]
        else:
            rid = (await self.post("/asample", SAMPLE))["request_id"]
        await self.wait(rid)
        self.done = [*self.done[-20:], rid]

    async def loop(self, rng: random.Random) -> None:
        ops, weights = list(MIX), list(MIX.values())
        await asyncio.sleep(rng.random() * self.think)  # spread the first requests out
        while not self.run.over:
            op = rng.choices(ops, weights)[0]
            sent = time.monotonic()
            await self.one(op)
            phase = self.run.phase(sent)
            if phase:
                self.run.latencies[(phase, op)].append((time.monotonic() - sent) * 1000)
            await asyncio.sleep(self.think * (0.5 + rng.random()))


def abuse(api: str, key: str, model: str, seconds: float, in_flight: int, counts: Any, mode: str) -> None:
    """Keep `in_flight` requests outstanding for `seconds` and never back off. It runs in a process of
    its own, so its client-side work does not slow the well-behaved clients' event loop: only what it
    costs the server shows in their latencies."""

    async def hammer(http: httpx.AsyncClient, stop: float, seen: dict[str, int]) -> None:
        path, body = ("/save_weights", {"model_id": model}) if mode == "save" else \
            ("/optim_step", {"model_id": model, "adam_params": {}})
        while time.monotonic() < stop:
            r = await http.post(path, json=body)
            seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1

    async def main() -> dict[str, int]:
        seen: dict[str, int] = {}
        async with httpx.AsyncClient(base_url=api, headers={"X-API-Key": key}, timeout=60,
                                     limits=httpx.Limits(max_connections=in_flight)) as http:
            stop = time.monotonic() + seconds
            await asyncio.gather(*(hammer(http, stop, seen) for _ in range(in_flight)))
        return seen

    counts.put(asyncio.run(main()))


async def start_abuser(api: str, abuser: Tenant, run: Run, in_flight: int, mode: str) -> None:
    await asyncio.sleep(run.phase_seconds)
    spawn = multiprocessing.get_context("spawn")
    counts = spawn.Queue()
    proc = spawn.Process(target=abuse, args=(api, abuser.headers["X-API-Key"], abuser.model, run.phase_seconds,
                                             in_flight, counts, mode))
    proc.start()
    while proc.is_alive() and counts.empty():
        await asyncio.sleep(0.2)
    run.abuser.update(counts.get(timeout=30))
    proc.join()


async def drive(api: str, ns: argparse.Namespace) -> Run:
    limits = httpx.Limits(max_connections=ns.clients + ns.abusers_in_flight + 16)
    async with httpx.AsyncClient(base_url=api, timeout=120, limits=limits) as http:
        run = Run(started=0, phase_seconds=ns.duration / 2)
        tenants = [Tenant(http, f"tml-load-{i}", run, ns.think_ms / 1000) for i in range(ns.clients)]
        abuser = Tenant(http, "tml-load-abuser", run, 0)
        for group in range(0, len(tenants), 10):
            await asyncio.gather(*(t.setup() for t in tenants[group : group + 10]))
        await abuser.setup()
        run.started = time.monotonic()
        rngs = [random.Random(i) for i in range(ns.clients)]
        await asyncio.gather(*(t.loop(rng) for t, rng in zip(tenants, rngs, strict=True)),
                             start_abuser(api, abuser, run, ns.abusers_in_flight, ns.abuse))
        return run


def report(run: Run, ns: argparse.Namespace) -> None:
    measured = run.phase_seconds - WARMUP_SECONDS
    print(f"{ns.clients} clients, think {ns.think_ms} ms, rps_limit {ns.rps_limit}/s per key, abuser sends "
          f"{'save_weights' if ns.abuse == 'save' else 'optim_step'} (checkpoint writes per key: "
          f"{ns.checkpoint_writes_per_key or 'unlimited'}); "
          f"two phases of {run.phase_seconds:g} s (first {WARMUP_SECONDS:g} s of each not measured)")
    print(f"{'op':<10} {'phase':<8} {'n':>6} {'ops/s':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for op in [*MIX, "all"]:
        for phase in ("without", "with"):
            ms = ([v for (p, _), vs in run.latencies.items() if p == phase for v in vs] if op == "all"
                  else run.latencies[(phase, op)])
            print(f"{op:<10} {phase:<8} {len(ms):>6} {len(ms) / measured:>7.1f} {pct(ms, 50):>8.1f} "
                  f"{pct(ms, 99):>8.1f}")
    without = [v for (p, _), vs in run.latencies.items() if p == "without" for v in vs]
    with_abuser = [v for (p, _), vs in run.latencies.items() if p == "with" for v in vs]
    abused = sum(run.abuser.values())
    print(f"abusive client: {abused} requests ({abused / run.phase_seconds:.0f}/s), by status "
          f"{dict(sorted(run.abuser.items()))}")
    print(f"well-behaved clients refused with 429: {sum(run.refused.values())}")
    ratio = pct(with_abuser, 99) / pct(without, 99)
    print(f"p99 with / without the abusive client: {ratio:.2f}x (target <= 2x; p50 "
          f"{pct(with_abuser, 50) / pct(without, 50):.2f}x)")
    print("note: client, API, workers and broker share this machine's cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60, help="seconds in all, half per phase")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--think-ms", type=float, default=500, help="mean pause between a client's ops")
    parser.add_argument("--rps-limit", type=float, default=20, help="requests/s per key on each pool")
    parser.add_argument("--abusers-in-flight", type=int, default=16, help="the abuser's concurrent requests")
    parser.add_argument("--abuse", choices=["optim", "save"], default="optim", help="what the abuser floods")
    parser.add_argument("--checkpoint-writes-per-key", type=int, default=2,
                        help="storage.checkpoint_writes_per_key (0 = unlimited)")
    ns = parser.parse_args()
    if ns.duration < 4 * WARMUP_SECONDS:
        parser.error(f"--duration must be at least {4 * WARMUP_SECONDS:g} s")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = Server(work, ensure_tiny_model(work / "tiny-qwen"), ns.rps_limit, ns.checkpoint_writes_per_key)
        server.start()
        try:
            run = asyncio.run(drive(server.api, ns))
        finally:
            server.stop()
    report(run, ns)


if __name__ == "__main__":
    main()
