"""LoRA slots as a cache: 64 tenants round-robin on 8 slots, through a launched server (transformers, CPU).

    python bench/slots.py [--quick] [--tenants 64] [--slots 8] [--rounds 3] [--small]

Each tenant is its own API key, session and LoRA adapter (rank 8). The tenants take turns: one training
step (forward_backward + optim_step on 1 x 32 tokens, both waited for) each, round after round, so with
more tenants than slots every step pages its adapter in and the least recently used one out. Printed per
tier (paged adapters kept in host memory; `page_host_mb: 0`, so every one goes to disk and back):

- step latency p50 / p99 (ms) with 64 tenants on 8 slots, next to 8 tenants on the same 8 slots (no
  paging) in the same run: the difference is what a page-in and a page-out cost a step;
- page-ins, bytes moved per page-in (the adapter's weights + Adam moments; from disk also the file read),
  the pool's time spent paging per page-in;
- errors: failed futures and non-2xx answers (target 0; before paging, tenant 9 got "All 8 LoRA slots").

`--quick` runs one round on the host tier only. The model is the test suite's tiny Qwen (hidden 64);
`--small` uses hidden 256, 4 layers, whose adapters are 8x larger.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.raw_client import Client
from tests.harness import LaunchedServer, launch
from twinkle.tiny_model import ensure_tiny_model

DB = 13  # shared with tests/e2e/test_adapter_slots.py (benchmarks do not run with the test suite)
QUEUE = "model.models-tiny.0"
SMALL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 1024, "num_heads": 8, "num_kv_heads": 4}


class Tenant(Client):
    """A raw-HTTP client that counts what went wrong instead of raising."""

    errors = 0

    def checked_step(self) -> float | None:
        started = time.perf_counter()
        a = self.c.post("/forward_backward", json=self.fb)
        b = self.c.post("/optim_step", json={"model_id": self.model, "adam_params": {}})
        if a.status_code != 200 or b.status_code != 200:
            Tenant.errors += 1
            return None
        results = [self.wait(a.json()["request_id"]), self.wait(b.json()["request_id"])]
        if any("error" in result for result in results):
            Tenant.errors += 1
            return None
        return (time.perf_counter() - started) * 1000


def paging(server: LaunchedServer) -> dict[str, float]:
    raw = server.redis.hgetall(server.keys.pool_paging(QUEUE))
    return {key.decode(): float(value) for key, value in raw.items()}


def round_robin(tenants: list[Tenant], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        for tenant in tenants:
            elapsed = tenant.checked_step()
            if elapsed is not None:
                times.append(elapsed)
    return times


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(work: Path, model_dir: Path, tier: str, args: argparse.Namespace) -> dict[str, Any]:
    adapter_config = {"page_host_mb": 0} if tier == "disk" else {}
    if tier == "disk":
        adapter_config["page_dir"] = str(work / "pages")
    (work / tier).mkdir()
    server = launch(work / tier, model_dir, db=DB, backend="transformers", max_loras=args.slots,
                    adapter_config=adapter_config, env={"OMP_NUM_THREADS": "1"})
    try:
        api = server.api
        Tenant.errors = 0
        tenants = [Tenant(api, f"tml-bench-slots-{tier}-{k}") for k in range(args.tenants)]
        round_robin(tenants[: args.slots], 1)  # warm up: first-use allocations, Adam state of the resident ones
        baseline = round_robin(tenants[: args.slots], args.rounds)
        round_robin(tenants, 1)  # every adapter trained once: each has its Adam moments when paged
        before = paging(server)
        paged = round_robin(tenants, args.rounds)
        after = paging(server)
        page_ins = after["page_ins"] - before["page_ins"]
        per_page_in = (after["bytes_paged_in"] - before["bytes_paged_in"]) / page_ins if page_ins else 0.0
        disk_read = after["bytes_read_from_disk"] - before["bytes_read_from_disk"]
        return {
            "tier": tier, "baseline": baseline, "paged": paged, "page_ins": page_ins,
            "bytes_per_page_in": per_page_in, "disk_bytes_per_page_in": disk_read / page_ins if page_ins else 0.0,
            "paging_ms_per_page_in": 1000 * (after["seconds_paging"] - before["seconds_paging"]) / max(page_ins, 1),
            "errors": Tenant.errors, "resident": after["resident"],
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, host tier only")
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="hidden 256, 4 layers instead of the tiny model")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-slots-") as tmp:
        work = Path(tmp)
        model_dir = ensure_tiny_model(work / "tiny-qwen", **(SMALL if args.small else {}))
        tiers = ["host"] if args.quick else ["host", "disk"]
        results = [measure(work, model_dir, tier, args) for tier in tiers]
    print(f"\n{args.tenants} tenants round-robin on {args.slots} slots, {args.rounds} round(s), "
          f"{'small' if args.small else 'tiny'} model, transformers on CPU")
    print("tier  | steps | step p50 / p99 (ms), 8 tenants | step p50 / p99 (ms), all | page-ins | "
          "bytes / page-in | disk bytes / page-in | paging ms / page-in | errors")
    for r in results:
        base, paged = r["baseline"], r["paged"]
        print(f"{r['tier']:5} | {len(paged):5} | {statistics.median(base):6.1f} / {percentile(base, 0.99):6.1f}"
              f"              | {statistics.median(paged):6.1f} / {percentile(paged, 0.99):6.1f}"
              f"        | {r['page_ins']:8.0f} | {r['bytes_per_page_in']:15,.0f} | {r['disk_bytes_per_page_in']:20,.0f}"
              f" | {r['paging_ms_per_page_in']:19.2f} | {r['errors']}")


if __name__ == "__main__":
    main()
