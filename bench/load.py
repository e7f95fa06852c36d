"""Many tenants at once, and one abusing its rate limit: does the abuser hurt the others?

    python bench/load.py [--duration 60] [--rounds 3] [--clients 50] [--rps-limit 20] [--abusers-in-flight 16]
                         [--abuse optim|save] [--checkpoint-writes-per-key 2]

Launches `twinkle-server launch` (embedded broker, 127.0.0.1 only) with the mock backend on the tiny
model: one model pool and one sampler pool whose `queue_config` limits every API key to `--rps-limit`
requests/s. `--clients` well-behaved tenants (each its own key and model) loop over a mix of ops,
each waited to completion: forward_backward 40 %, optim_step 25 %, sample 25 %, retrieve of an old
result 10 %, with `--think-ms` between ops (and obeying Retry-After if they ever get a 429). The run
alternates `--rounds` windows without and `--rounds` windows with one abusive client (each window
`--duration`/(2 x rounds) seconds, its first seconds not measured), so that drift in what the shared
machine gives the run (CPU steal, disk) falls on both phases alike. The abusive client keeps
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
WARMUP_SECONDS = 2.0  # of each window: the abuser starting or stopping


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
    window_seconds: float
    rounds: int
    latencies: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    abuser: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_window: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))

    @property
    def seconds(self) -> float:
        return 2 * self.rounds * self.window_seconds

    @property
    def measured_seconds(self) -> float:
        """Seconds measured per phase."""
        return self.rounds * (self.window_seconds - WARMUP_SECONDS)

    def window(self, at: float) -> int:
        return int((at - self.started) // self.window_seconds)

    def phase(self, at: float) -> str | None:
        """Even windows run without the abuser, odd ones with it; a window's first seconds count for neither."""
        elapsed = at - self.started
        if not 0 <= elapsed < self.seconds or elapsed % self.window_seconds < WARMUP_SECONDS:
            return None
        return "with" if self.window(at) % 2 else "without"

    @property
    def over(self) -> bool:
        return time.monotonic() - self.started >= self.seconds


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
                ms = (time.monotonic() - sent) * 1000
                self.run.latencies[(phase, op)].append(ms)
                self.run.by_window[self.run.window(sent)].append(ms)
            await asyncio.sleep(self.think * (0.5 + rng.random()))


def abuse(api: str, key: str, model: str, in_flight: int, events: tuple[Any, Any, Any], counts: Any,
          mode: str) -> None:
    """While `on` is set, keep `in_flight` requests outstanding and never back off; stop once `done` is set.
    It runs in a process of its own, so its client-side work does not slow the well-behaved clients' event
    loop: only what it costs the server (and the cores it shares with it) shows in their latencies."""
    ready, on, done = events

    async def hammer(http: httpx.AsyncClient, seen: dict[str, int]) -> None:
        path, body = ("/save_weights", {"model_id": model}) if mode == "save" else \
            ("/optim_step", {"model_id": model, "adam_params": {}})
        while not done.is_set():
            if not on.is_set():
                await asyncio.sleep(0.05)
                continue
            r = await http.post(path, json=body)
            seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1

    async def main() -> dict[str, int]:
        seen: dict[str, int] = {}
        async with httpx.AsyncClient(base_url=api, headers={"X-API-Key": key}, timeout=60,
                                     limits=httpx.Limits(max_connections=in_flight)) as http:
            ready.set()
            await asyncio.gather(*(hammer(http, seen) for _ in range(in_flight)))
        return seen

    counts.put(asyncio.run(main()))


class Abuser:
    """The abusive client's process, started (and idle) before the run so that its start-up costs no window."""

    def __init__(self, api: str, tenant: Tenant, in_flight: int, mode: str) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.ready, self.on, self.done, self.counts = spawn.Event(), spawn.Event(), spawn.Event(), spawn.Queue()
        self.proc = spawn.Process(target=abuse, args=(api, tenant.headers["X-API-Key"], tenant.model, in_flight,
                                                      (self.ready, self.on, self.done), self.counts, mode))
        self.proc.start()
        if not self.ready.wait(60):
            raise RuntimeError("the abusive client did not start")


async def drive_abuser(abuser: Abuser, run: Run) -> None:
    """Turn the abusive client on for the odd windows and off for the even ones."""
    on, done = abuser.on, abuser.done
    for window in range(2 * run.rounds):
        await asyncio.sleep(max(0.0, run.started + window * run.window_seconds - time.monotonic()))
        (on.set if window % 2 else on.clear)()
    await asyncio.sleep(max(0.0, run.started + run.seconds - time.monotonic()))
    on.clear()
    done.set()
    run.abuser.update(await asyncio.to_thread(abuser.counts.get, timeout=90))
    abuser.proc.join()


async def drive(api: str, ns: argparse.Namespace) -> Run:
    limits = httpx.Limits(max_connections=ns.clients + ns.abusers_in_flight + 16)
    async with httpx.AsyncClient(base_url=api, timeout=120, limits=limits) as http:
        run = Run(started=0, window_seconds=ns.duration / (2 * ns.rounds), rounds=ns.rounds)
        tenants = [Tenant(http, f"tml-load-{i}", run, ns.think_ms / 1000) for i in range(ns.clients)]
        abusive = Tenant(http, "tml-load-abuser", run, 0)
        for group in range(0, len(tenants), 10):
            await asyncio.gather(*(t.setup() for t in tenants[group : group + 10]))
        await abusive.setup()
        abuser = await asyncio.to_thread(Abuser, api, abusive, ns.abusers_in_flight, ns.abuse)
        run.started = time.monotonic()
        rngs = [random.Random(i) for i in range(ns.clients)]
        await asyncio.gather(*(t.loop(rng) for t, rng in zip(tenants, rngs, strict=True)), drive_abuser(abuser, run))
        return run


def report(run: Run, ns: argparse.Namespace) -> None:
    measured = run.measured_seconds
    print(f"{ns.clients} clients, think {ns.think_ms} ms, rps_limit {ns.rps_limit}/s per key, abuser sends "
          f"{'save_weights' if ns.abuse == 'save' else 'optim_step'} (checkpoint writes per key: "
          f"{ns.checkpoint_writes_per_key or 'unlimited'}); "
          f"{run.rounds} windows of {run.window_seconds:g} s without and {run.rounds} with, alternating (first "
          f"{WARMUP_SECONDS:g} s of each not measured)")
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
    print(f"abusive client: {abused} requests ({abused / (run.seconds / 2):.0f}/s while on), by status "
          f"{dict(sorted(run.abuser.items()))}")
    print("p99 ms by window (without | with): " + "  ".join(
        f"{pct(run.by_window[w], 99):.0f}{' |' if w % 2 == 0 else ','}" for w in range(2 * run.rounds)).rstrip(","))
    print(f"well-behaved clients refused with 429: {sum(run.refused.values())}")
    ratio = pct(with_abuser, 99) / pct(without, 99)
    print(f"p99 with / without the abusive client: {ratio:.2f}x (target <= 2x; p50 "
          f"{pct(with_abuser, 50) / pct(without, 50):.2f}x)")
    print("note: client, API, workers and broker share this machine's cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60, help="seconds in all, half per phase")
    parser.add_argument("--rounds", type=int, default=3, help="windows per phase, alternating")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--think-ms", type=float, default=500, help="mean pause between a client's ops")
    parser.add_argument("--rps-limit", type=float, default=20, help="requests/s per key on each pool")
    parser.add_argument("--abusers-in-flight", type=int, default=16, help="the abuser's concurrent requests")
    parser.add_argument("--abuse", choices=["optim", "save"], default="optim", help="what the abuser floods")
    parser.add_argument("--checkpoint-writes-per-key", type=int, default=2,
                        help="storage.checkpoint_writes_per_key (0 = unlimited)")
    ns = parser.parse_args()
    if ns.rounds < 1 or ns.duration / (2 * ns.rounds) < 2 * WARMUP_SECONDS:
        parser.error(f"each of the 2 x --rounds windows must last at least {2 * WARMUP_SECONDS:g} s")
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
