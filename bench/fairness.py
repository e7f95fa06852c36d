"""Fair share between tenants on one model pool, through a launched server (transformers backend, CPU).

    python bench/fairness.py [--quick] [--duration 20] [--phases 1,2,3,4,5] [--light 4] [--heavy-inflight 8]
                             [--heavy-rows 8] [--heavy-tokens 512] [--scheduling auto|none|JSON]

Launches `twinkle-server launch` (its own embedded Valkey broker, 127.0.0.1 only) with one transformers
model pool on the small model (hidden 256, 4 layers, as `bench/training.py` builds it) and drives it with
raw-HTTP clients (`bench/raw_client.py`), each tenant its own API key and LoRA adapter (rank 8). The server
has a keys file (`auth.keys_file`) that lists every key the bench uses, one line each,
`<sha256 of the key> <label> <created> weight=<n>`, so the weights of phase 4 reach a server that reads them
and a server that does not simply accepts the keys. Phases, each `--duration` seconds (its first second
not measured):

1. Solo: `--light` light tenants, each a closed loop of steps (forward_backward of 2 x 64 tokens and
   optim_step, submitted back to back, both waited for): light step p50 / p99.
2. Heavy solo: one heavy tenant alone keeping `--heavy-inflight` steps submitted-but-unfinished (each step
   forward_backward of 8 x 512 tokens + optim_step). H = the p50 of the heavy forward_backward's run time
   on the pool (`finished_at - started_at` of its future record in Redis).
3. Contended: the light tenants and the heavy tenant together. Light step p50 / p99, the light tenants'
   wait beyond solo ((contended p50 or p99 - solo p50) / H; target <= 1.5 H), and each tenant's token
   share: forward_backward tokens the pool processed for it in the measured window / all.
4. Weights: two heavy tenants, keys-file weights 1 and 2, both backlogged: each one's token share and the
   ratio (target 2.0 within 10 %). The weight each future record carries is printed too.
5. Metering cost: light tenants' solo step p50 on a server with `usage: {enabled: false}` vs the main one
   (`enabled: true`), both up, in alternating windows (on, off, off, on, ...) so that the host's drift falls
   on both; target: enabled costs <= 5 % of the step p50.

Token shares count the pool time each op ran inside the window (an op half inside counts half its tokens),
so that a window a few heavy ops long is not rounded to whole ops; the count of ops that finished in it is
printed next to them. Every figure comes with its phase's errors (failed futures, broken connections),
timeouts (no answer in 300 s, a client timeout) and non-2xx answers; a phase with any says so loudly.

The model app gets a `scheduling` section when this server's config has one (`--scheduling auto`:
`{enabled: true}` if it has an `enabled` field, else `{}`, its defaults; `none` leaves it out; `fair` and
`fifo` give `{policy: fair|fifo}`; or a JSON mapping). `--scheduling fifo`, or a server without the
section, runs ops in arrival order: the baseline the targets are measured against.

`--quick` runs each phase 6 s (phase 5: one window each) as a smoke run. The default sizes make H about
2-3 s on a 2-core host, so a contended light step takes a few H and 20 s gives few light steps: use
`--duration 60` or more for p99s that mean something, or shrink the heavy op (`--heavy-rows`,
`--heavy-tokens`). Client, API, pool worker and broker share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import httpx
import redis
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.raw_client import BenchServer, Client, datum, pct
from tests.harness import free_port, mock_config
from twinkle.auth import hash_key, tenant_id
from twinkle.keys import Keys
from twinkle.tiny_model import ensure_tiny_model

SMALL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 1024, "num_heads": 8, "num_kv_heads": 4}
LIGHT_ROWS, LIGHT_TOKENS = 2, 64
STEP_TIMEOUT = 300.0  # seconds a step may take before it counts as a timeout
WARMUP = 1.0  # seconds at the start of each phase (window) not measured
WAIT_TARGET_H = 1.5
WEIGHTS = (1.0, 2.0)
RATIO_TOLERANCE = 0.10
METERING_TARGET = 0.05


# ---------------------------------------------------------------------------------------------- clients


@dataclass
class Failures:
    errors: int = 0
    timeouts: int = 0
    non_2xx: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str) -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)

    @property
    def total(self) -> int:
        return self.errors + self.timeouts + self.non_2xx

    def merge(self, other: Failures) -> None:
        self.errors += other.errors
        self.timeouts += other.timeouts
        self.non_2xx += other.non_2xx

    def __str__(self) -> str:
        text = f"{self.errors} / {self.timeouts} / {self.non_2xx}"
        return f"!! {text} FAILED" if self.total else text


@dataclass
class Step:
    tenant: str
    fb: str
    optim: str
    submitted: float  # time.time()
    latency_ms: float | None = None  # None: the step failed


class Tenant(Client):
    """A raw-HTTP client (its own key, session and adapter) that counts what went wrong instead of raising."""

    def __init__(self, api: str, key: str, name: str, rows: int, tokens: int) -> None:
        super().__init__(api, key, timeout=60)
        self.key, self.name, self.tokens = key, name, rows * tokens
        self.fb = {"model_id": self.model,
                   "forward_backward_input": {"data": [datum(tokens)] * rows, "loss_fn": "cross_entropy"}}
        self.optim = {"model_id": self.model, "adam_params": {}}
        self.failures = Failures()
        if self.one_step().latency_ms is None:  # warm up: first-use allocations, the adapter's Adam moments
            raise RuntimeError(f"{name}: the warm-up step failed ({self.failures})")

    def submit(self, path: str, body: dict[str, Any]) -> str | None:
        try:
            r = self.c.post(path, json=body)
        except httpx.TimeoutException:
            self.failures.add("timeouts")
            return None
        except httpx.HTTPError:
            self.failures.add("errors")
            return None
        if not r.is_success:
            self.failures.add("non_2xx")
            return None
        return str(r.json()["request_id"])

    def finish(self, rid: str, deadline: float) -> bool:
        """Wait for the future `rid`; false (and counted) if it failed or is not done by `deadline`."""
        while True:
            if time.time() > deadline:
                self.failures.add("timeouts")
                return False
            try:
                r = self.c.post("/retrieve_future", json={"request_id": rid})
            except httpx.TimeoutException:
                self.failures.add("timeouts")
                return False
            except httpx.HTTPError:
                self.failures.add("errors")
                return False
            if not r.is_success:
                self.failures.add("non_2xx")
                return False
            body = r.json()
            if body.get("type") == "try_again":
                continue
            if "error" in body:
                self.failures.add("errors")
                return False
            return True

    def send_step(self) -> Step | None:
        submitted = time.time()
        fb = self.submit("/forward_backward", self.fb)
        optim = self.submit("/optim_step", self.optim) if fb else None
        return Step(self.name, fb, optim, submitted) if fb and optim else None

    def complete(self, step: Step) -> Step:
        deadline = step.submitted + STEP_TIMEOUT
        if self.finish(step.fb, deadline) and self.finish(step.optim, deadline):
            step.latency_ms = (time.time() - step.submitted) * 1000
        return step

    def one_step(self) -> Step:
        sent = self.send_step()
        return self.complete(sent) if sent else Step(self.name, "", "", time.time())


def closed_loop(tenant: Tenant, until: float, steps: list[Step]) -> None:
    """One step at a time until `until`; the step under way then is finished."""
    while time.time() < until:
        step = tenant.one_step()
        steps.append(step)
        if step.latency_ms is None:
            time.sleep(0.1)  # do not spin on a server that refuses


def pipelined(tenant: Tenant, in_flight: int, until: float, steps: list[Step]) -> None:
    """Keep `in_flight` steps submitted and unfinished until `until`, then finish the ones under way (the
    ops of one adapter run in order, so waiting for the oldest first loses nothing)."""
    queue: deque[Step] = deque()
    while True:
        while len(queue) < in_flight and time.time() < until:
            sent = tenant.send_step()
            if sent is None:
                steps.append(Step(tenant.name, "", "", time.time()))
                time.sleep(0.1)
                continue
            queue.append(sent)
        if not queue:
            return
        steps.append(tenant.complete(queue.popleft()))


def run_together(loops: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=loop) for loop in loops]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ----------------------------------------------------------------------------------------------- server


def scheduling_section(choice: str) -> dict[str, Any] | None:
    """The model app's `scheduling` section, where this server's config has one."""
    if choice == "none":
        return None
    if choice in ("fair", "fifo"):
        return {"policy": choice}
    if choice != "auto":
        value: dict[str, Any] = json.loads(choice)
        return value
    from twinkle.config.args import ModelArgs

    found = ModelArgs.model_fields.get("scheduling")
    if found is None:
        return None
    models = [a for a in (found.annotation, *get_args(found.annotation))
              if isinstance(a, type) and issubclass(a, BaseModel)]
    return {"enabled": True} if models and "enabled" in models[0].model_fields else {}


class Server(BenchServer):
    """A launched server with one transformers model pool and its own embedded broker."""

    def __init__(self, work: Path, model_dir: Path, keys_file: Path, *, usage: bool,
                 scheduling: dict[str, Any] | None) -> None:
        work.mkdir(parents=True, exist_ok=True)
        config = mock_config(model_dir, work / "ckpt", port=free_port(), db=0, backend="transformers",
                             max_loras=32, auth={"keys_file": str(keys_file)})
        del config["broker"]  # an embedded Valkey of its own: no shared database to flush or be flushed
        config["usage"] = {"enabled": usage}
        if scheduling is not None:
            config["applications"][1]["args"]["scheduling"] = scheduling
        super().__init__(work, "fairness", config, env={"OMP_NUM_THREADS": "1"})
        self.redis: redis.Redis | None = None

    def start(self) -> float:
        seconds = super().start()
        self.log.seek(0)
        found = re.search(r"embedded Valkey broker at (\S+)", self.log.read())
        if found:
            self.redis = redis.Redis.from_url(found.group(1))
        return seconds

    def records(self, rids: list[str]) -> dict[str, dict[str, str]]:
        """The future records of `rids` (request id -> fields), those still in the broker."""
        if self.redis is None:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.hgetall(Keys("").future(rid))
        out = {}
        for rid, raw in zip(rids, pipe.execute(), strict=True):
            if raw:
                out[rid] = {k.decode(): v.decode() for k, v in raw.items()}
        return out


def write_keys_file(path: Path, weights: dict[str, float]) -> None:
    created = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    lines = [f"{hash_key(key)} {key.removeprefix('tml-')} {created} weight={weight:g}"
             for key, weight in weights.items()]
    path.write_text("# bench/fairness.py keys: <sha256> <label> <created> weight=<n>\n" + "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------- figures


def run_times_ms(records: dict[str, dict[str, str]], rids: list[str]) -> list[float]:
    """The pool run time of each completed op of `rids` whose record has both times."""
    out = []
    for rid in rids:
        rec = records.get(rid, {})
        started, finished = float(rec.get("started_at", 0)), float(rec.get("finished_at", 0))
        if rec.get("status") == "completed" and started and finished >= started:
            out.append((finished - started) * 1000)
    return out


def token_shares(steps: list[Step], records: dict[str, dict[str, str]], tokens: dict[str, int],
                 lo: float, hi: float) -> tuple[dict[str, float], dict[str, int]]:
    """Tokens each tenant's forward_backwards processed inside [lo, hi] (an op counts the part of its run
    time inside), and how many of them finished inside."""
    processed = dict.fromkeys(tokens, 0.0)
    finished_in = dict.fromkeys(tokens, 0)
    for step in steps:
        rec = records.get(step.fb, {})
        started, finished = float(rec.get("started_at", 0)), float(rec.get("finished_at", 0))
        if rec.get("status") != "completed" or not started or finished <= started:
            continue
        overlap = max(0.0, min(hi, finished) - max(lo, started))
        processed[step.tenant] += tokens[step.tenant] * overlap / (finished - started)
        finished_in[step.tenant] += lo <= finished <= hi
    return processed, finished_in


def latencies(steps: list[Step], since: float, names: set[str] | None = None) -> list[float]:
    return [s.latency_ms for s in steps
            if s.latency_ms is not None and s.submitted >= since and (names is None or s.tenant in names)]


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


@dataclass
class Bench:
    args: argparse.Namespace
    server: Server
    model_dir: Path
    work: Path
    keys_file: Path
    rows: list[tuple[str, str, str, str, Failures]] = field(default_factory=list)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    light_solo_p50: float | None = None
    h_ms: float | None = None

    def row(self, phase: str, figure: str, measured: str, target: str, failures: Failures) -> None:
        self.rows.append((phase, figure, measured, target, failures))
        print(f"  {phase}: {figure}: {measured}  {target}  [errors / timeouts / non-2xx: {failures}]",
              file=sys.stderr, flush=True)

    def tenant(self, name: str, heavy: bool = False, server: Server | None = None) -> Tenant:
        """The tenant `name` (key tml-fair-`name`) on `server`, created and warmed up on first use."""
        server = server or self.server
        slot = f"{name}@{server.port}"
        if slot not in self.tenants:
            rows, tokens = (self.args.heavy_rows, self.args.heavy_tokens) if heavy else (LIGHT_ROWS, LIGHT_TOKENS)
            self.tenants[slot] = Tenant(server.api, f"tml-fair-{name}", name, rows, tokens)
        return self.tenants[slot]

    def lights(self, server: Server | None = None) -> list[Tenant]:
        return [self.tenant(f"light-{i}", server=server) for i in range(self.args.light)]

    def run(self, tenants: list[Tenant], heavies: list[Tenant], seconds: float) -> tuple[list[Step], Failures,
                                                                                          float, float]:
        """Light tenants in closed loops and heavy ones pipelined, for `seconds`; the steps, the failures
        during them, and the measured window [start + WARMUP, end] in time.time()."""
        for t in [*tenants, *heavies]:
            t.failures = Failures()
        steps: list[Step] = []
        start = time.time()
        until = start + seconds
        loops: list[Callable[[], None]] = [
            *(lambda h=h: pipelined(h, self.args.heavy_inflight, until, steps) for h in heavies),
            *(lambda t=t: closed_loop(t, until, steps) for t in tenants)]
        run_together(loops)
        failures = Failures()
        for t in [*tenants, *heavies]:
            failures.merge(t.failures)
        return steps, failures, start + min(WARMUP, seconds / 4), until

    # --- the phases

    def solo(self) -> None:
        lights = self.lights()
        steps, failures, lo, _ = self.run(lights, [], self.args.duration)
        ms = latencies(steps, lo)
        self.light_solo_p50 = pct(ms, 50)
        recs = self.server.records([s.fb for s in steps if s.latency_ms is not None])
        fb_ms = run_times_ms(recs, list(recs))
        self.row("1 solo", f"light step p50 / p99 ({len(lights)} tenants, {LIGHT_ROWS}x{LIGHT_TOKENS} tok, "
                 f"n={len(ms)})", f"{pct(ms, 50):.0f} / {pct(ms, 99):.0f} ms", "", failures)
        self.row("1 solo", "light forward_backward run time on the pool, p50", f"{pct(fb_ms, 50):.0f} ms", "",
                 failures)

    def heavy_solo(self) -> None:
        heavy = self.tenant("heavy", heavy=True)
        steps, failures, lo, hi = self.run([], [heavy], self.args.duration)
        recs = self.server.records([s.fb for s in steps if s.latency_ms is not None])
        fb_ms = run_times_ms(recs, list(recs))
        if fb_ms:
            self.h_ms, source = pct(fb_ms, 50), f"pool run time of its forward_backward, n={len(fb_ms)}"
        else:  # no times on the records: the step latency with one step in flight
            heavy.failures = Failures()
            solo: list[Step] = []
            pipelined(heavy, 1, time.time() + self.args.duration / 2, solo)
            self.h_ms, source = pct(latencies(solo, 0), 50), "step latency at 1 in flight (no times on records)"
            failures.merge(heavy.failures)
        # steady state: the steps sent after the first `--heavy-inflight` (those filled an empty pipeline)
        sent = sorted((s for s in steps if s.fb), key=lambda s: s.submitted)[self.args.heavy_inflight:]
        done = latencies(sent, lo)
        processed, _ = token_shares(steps, recs, {heavy.name: heavy.tokens}, lo, hi)
        tokens = processed[heavy.name]
        self.row("2 heavy", f"H = heavy op ({self.args.heavy_rows}x{self.args.heavy_tokens} tok) p50, {source}",
                 f"{self.h_ms:.0f} ms (p99 {pct(fb_ms, 99):.0f})", "", failures)
        self.row("2 heavy", f"heavy step latency p50 at {self.args.heavy_inflight} in flight, steady state "
                 f"(n={len(done)}); heavy tokens/s", f"{pct(done, 50):.0f} ms; {tokens / max(hi - lo, 1e-9):.0f} tok/s",
                 "", failures)

    def contended(self) -> None:
        lights, heavy = self.lights(), self.tenant("heavy", heavy=True)
        steps, failures, lo, hi = self.run(lights, [heavy], self.args.duration)
        names = {t.name for t in lights}
        ms = latencies(steps, lo, names)
        recs = self.server.records([s.fb for s in steps if s.fb])
        if self.h_ms is None:  # phase 2 not run: H from this phase's heavy ops
            heavy_ms = run_times_ms(recs, [s.fb for s in steps if s.tenant == heavy.name])
            self.h_ms = pct(heavy_ms, 50) if heavy_ms else None
        self.row("3 contended", f"light step p50 / p99 (n={len(ms)}, heavy {self.args.heavy_inflight} in flight)",
                 f"{pct(ms, 50):.0f} / {pct(ms, 99):.0f} ms", "", failures)
        for q in (50, 99):
            if self.light_solo_p50 is None or not self.h_ms:
                self.row("3 contended", f"light wait beyond solo, p{q}", "n/a (needs phase 1, and H)",
                         f"<= {WAIT_TARGET_H:g} H", failures)
                continue
            wait_h = (pct(ms, q) - self.light_solo_p50) / self.h_ms
            self.row("3 contended", f"light wait beyond solo, p{q} - solo p50 (H = {self.h_ms:.0f} ms)",
                     f"{wait_h:.2f} H", f"<= {WAIT_TARGET_H:g} H: {verdict(wait_h <= WAIT_TARGET_H)}", failures)
        tokens = {t.name: t.tokens for t in [*lights, heavy]}
        shares, counts = token_shares(steps, recs, tokens, lo, hi)
        total = sum(shares.values()) or 1.0
        light_total = sum(shares[n] for n in names) / total
        self.row("3 contended", "token share, " + ", ".join(shares),
                 ", ".join(f"{shares[n] / total:.1%} ({counts[n]})" for n in shares)
                 + f"; lights together {light_total:.1%}", "", failures)

    def weights(self) -> None:
        a, b = self.tenant("heavy-w1", heavy=True), self.tenant("heavy-w2", heavy=True)
        steps, failures, lo, hi = self.run([], [a, b], self.args.duration)
        recs = self.server.records([s.fb for s in steps if s.fb])
        shares, counts = token_shares(steps, recs, {a.name: a.tokens, b.name: b.tokens}, lo, hi)
        total = sum(shares.values()) or 1.0
        on_record = {t.name: sorted({float(r.get("weight", 1)) for s in steps if s.tenant == t.name
                                     and (r := recs.get(s.fb))}) for t in (a, b)}
        record_text = " / ".join(",".join(f"{w:g}" for w in on_record[t.name]) or "?" for t in (a, b))
        self.row("4 weights", f"token share, weight {WEIGHTS[0]:g} / {WEIGHTS[1]:g} (weight on the future "
                 f"records: {record_text}; ops finished {counts[a.name]} / {counts[b.name]})",
                 f"{shares[a.name] / total:.1%} / {shares[b.name] / total:.1%}", "", failures)
        ratio = shares[b.name] / shares[a.name] if shares[a.name] else float("nan")
        want = WEIGHTS[1] / WEIGHTS[0]
        self.row("4 weights", "share ratio, weight 2 / weight 1", f"{ratio:.2f}",
                 f"{want:.1f} within {RATIO_TOLERANCE:.0%}: {verdict(abs(ratio / want - 1) <= RATIO_TOLERANCE)}",
                 failures)

    def metering(self) -> None:
        scheduling = scheduling_section(self.args.scheduling)
        off = Server(self.work / "usage-off", self.model_dir, self.keys_file, usage=False, scheduling=scheduling)
        off.start()
        try:
            servers = {"on": self.server, "off": off}
            lights = {mode: self.lights(server) for mode, server in servers.items()}
            order = [mode for i in range(self.args.rounds) for mode in (("on", "off"), ("off", "on"))[i % 2]]
            window = self.args.duration / self.args.rounds
            ms: dict[str, list[float]] = {"on": [], "off": []}
            failures = Failures()
            for mode in order:
                steps, failed, lo, _ = self.run(lights[mode], [], window)
                ms[mode] += latencies(steps, lo)
                failures.merge(failed)
        finally:
            off.stop()
        on50, off50 = pct(ms["on"], 50), pct(ms["off"], 50)
        self.row("5 metering", f"light step p50, usage off / on ({len(order) // 2} windows of {window:.0f} s each, "
                 f"n={len(ms['off'])} / {len(ms['on'])})", f"{off50:.0f} / {on50:.0f} ms", "", failures)
        cost = on50 / off50 - 1
        self.row("5 metering", "metering cost, on / off - 1", f"{cost:+.1%}",
                 f"<= {METERING_TARGET:.0%}: {verdict(cost <= METERING_TARGET)}", failures)


def print_table(rows: list[tuple[str, str, str, str, Failures]]) -> None:
    head = ("phase", "figure", "measured", "target", "errors / timeouts / non-2xx")
    table = [head, *((p, f, m, t, str(x)) for p, f, m, t, x in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for i, r in enumerate(table):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    failed = {}
    for phase, *_, failures in rows:
        if failures.total:
            failed[phase] = failures
    for phase, failures in failed.items():
        print(f"!!! PHASE {phase.upper()} HAD FAILURES: {failures.errors} errors, {failures.timeouts} timeouts, "
              f"{failures.non_2xx} non-2xx answers: its figures are not trustworthy !!!")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=None, help="seconds per phase (default 20; --quick 6)")
    parser.add_argument("--phases", default="1,2,3,4,5", help="a subset of 1,2,3,4,5")
    parser.add_argument("--light", type=int, default=4, help="light tenants")
    parser.add_argument("--heavy-inflight", type=int, default=8, help="steps each heavy tenant keeps in flight")
    parser.add_argument("--heavy-rows", type=int, default=8, help="rows of the heavy forward_backward")
    parser.add_argument("--heavy-tokens", type=int, default=512, help="tokens per row of the heavy op")
    parser.add_argument("--rounds", type=int, default=2,
                        help="phase 5: windows per setting, alternating on, off, off, on, ...")
    parser.add_argument("--scheduling", default="auto",
                        help="the model app's scheduling section: auto, none, fair, fifo ({policy: ...}) or JSON")
    parser.add_argument("--quick", action="store_true", help="short phases, one window each in phase 5")
    args = parser.parse_args()
    if args.duration is None:
        args.duration = 6.0 if args.quick else 20.0
    if args.quick:
        args.rounds = 1
    phases = {int(p) for p in args.phases.split(",") if p.strip()}
    if not phases or not phases <= {1, 2, 3, 4, 5}:
        parser.error("--phases takes a subset of 1,2,3,4,5")
    scheduling = scheduling_section(args.scheduling)
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-fairness-") as tmp:
        work = Path(tmp)
        model_dir = ensure_tiny_model(work / "tiny-qwen", **SMALL)
        keys_file = work / "keys"
        weights = {f"tml-fair-light-{i}": 1.0 for i in range(args.light)}
        weights |= {"tml-fair-heavy": 1.0, "tml-fair-heavy-w1": WEIGHTS[0], "tml-fair-heavy-w2": WEIGHTS[1]}
        write_keys_file(keys_file, weights)
        server = Server(work / "main", model_dir, keys_file, usage=True, scheduling=scheduling)
        ready = server.start()
        bench = Bench(args, server, model_dir, work, keys_file)
        print(f"server ready in {ready:.1f} s; scheduling section: "
              f"{json.dumps(scheduling) if scheduling is not None else 'none (arrival order)'}; "
              f"tenants: {', '.join(f'{k} -> {tenant_id(k)}' for k in list(weights)[-3:])}", file=sys.stderr)
        steps = [(1, "solo", bench.solo), (2, "heavy solo", bench.heavy_solo), (3, "contended", bench.contended),
                 (4, "weights", bench.weights), (5, "metering", bench.metering)]
        try:
            for number, name, phase in steps:
                if number in phases:
                    print(f"phase {number} ({name}), {args.duration:g} s ...", file=sys.stderr, flush=True)
                    phase()
        finally:
            server.stop()
    print(f"\nfair share on one transformers pool, small model (hidden 256, 4 layers, CPU, 1 torch thread); "
          f"{args.light} light tenants ({LIGHT_ROWS}x{LIGHT_TOKENS} tok steps, closed loop), heavy steps "
          f"{args.heavy_rows}x{args.heavy_tokens} tok, {args.heavy_inflight} in flight; {args.duration:g} s per "
          f"phase; scheduling section: {json.dumps(scheduling) if scheduling is not None else 'none'}; "
          f"{datetime.now(UTC):%Y-%m-%d}")
    print_table(bench.rows)


if __name__ == "__main__":
    main()
