"""The Tinker SDK path against its floor: Twinkle (mock backend) next to a stand-in server that answers at once.

    python bench/sdk_floor.py [--rounds 2] [--steps 200] [--seconds 10] [--samples 200] [--trace 200]
                              [--burdened 1,0.85,0.7,0.5]

The real Tinker SDK (0.38) costs time of its own: its background event loop, pydantic models, protobuf,
the per-call turn it takes, and four HTTP requests per training step (forward_backward and optim_step, then a
`retrieve_future` for each). The stand-in here is the floor any server reaches on this machine through that
SDK: a plain ASGI app on the same uvicorn (uvloop, httptools) as Twinkle's API, serving only the routes the
SDK's training and sampling clients call, resolving every op's future at once in memory, but reading and
writing the same protobuf through Twinkle's own codecs (`decode_forward_backward`,
`encode_forward_backward_output`, `encode_sample_output`).

Both servers run at once, and the same SDK benchmark alternates between them in rounds (floor, Twinkle,
floor, Twinkle, ...), so the host's drift falls on both:

- step: one training client, forward_backward of 4 datums x 128 tokens and optim_step submitted back to
  back, then both results waited for (the SDK's pipelining as users write it), p50 / p99;
- aggregate steps/s of 16 training clients (one ServiceClient each) stepping in 16 threads;
- sample: one sampling client, 16 tokens, p50 / p99;

then the ratios Twinkle / floor per round and over all rounds. Before round 1 each server's 16 clients step for
`--warmup` seconds, not counted: without it the floor's first round was cold (its 16 clients 176-178 steps/s
against 194-197 in later rounds), which flattered Twinkle's first ratio. Every figure comes with its errors (a call that
raised), timeouts (a result later than `--timeout`) and the non-2xx answers the server gave (Twinkle's access
log, which writes every status >= 400 even at WARNING; the stand-in counts its own).

Every process's CPU time (user + system) is counted over the single-client steps and over the 16-client
window: this process (the SDK clients), and each process of the server (the stand-in; Twinkle's API, pool
worker, broker and launcher), in milliseconds per step. Client and server share the machine's cores, so the
sum bounds the aggregate (`cores / CPU per step`), and the last line says what the cores leave the server for
the 16-client target: at 0.8x the floor's rate each step gets `cores / rate` of CPU, the SDK clients take
theirs, and the rest is what the server may spend.

`--trace N` follows N more Twinkle steps and N samples op by op: the SDK's submit and result times next to the future
record's own (accepted by the API, begun and finished by the pool worker), read from the launch's embedded
broker, and prints the median of each stage. Then N more steps of each server, taking turns every 10 steps: when
the SDK sent each of a step's four requests and when their answers arrived, the servers side by side.

`--burdened SCALES` asks how much of Twinkle's distance from the floor is its CPU and how much its hops (the
queue, the worker's delivery, the hand-backs): after the rounds, for each scale a stand-in is started that spends
its own CPU plus that scale times what Twinkle's server spent beyond it a step in the 16-client windows (the API's
excess spun in the stand-in's event loop on each request, the worker's, broker's and launcher's in a burner
process on each forward_backward and optim_step, whose future resolves when the burner is done), and its step and
16-client rate are measured as the floor's are. At scale 1 it costs what Twinkle costs with none of its hops; the
scale at which it reaches 0.8x is the server CPU a step the target needs on these cores.

Targets on the 2-core machine, in the same run: step p50 <= 1.6x the floor, 16-client steps/s >= 0.8x the
floor, sample p50 <= 2x the floor, 0 errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from raw_client import BenchServer, one_pool_config, pct  # noqa: E402

from api.sdk_flags import sdk_flags  # noqa: E402
from api.tinker_codec import (  # noqa: E402
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_output,
)
from tests.harness import free_port  # noqa: E402
from twinkle.types import ForwardBackwardOutput, SampledSequence, SampleOutput  # noqa: E402

BASE_MODEL = "tiny-qwen"
CORES = len(os.sched_getaffinity(0))
DATUMS, TOKENS = 4, 128

# -- the stand-in ------------------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
PROTOBUF = "application/x-protobuf"


@dataclass
class Burden:
    """CPU a burdened stand-in spends like a server with a queue and a worker: `request_ms` in its event loop on
    every request, and `op_ms` in a separate burner process on each forward_backward and optim_step, whose future
    resolves only when the burner is done (a `retrieve_future` before then waits, as a long-poll does)."""

    request_ms: float
    op_ms: float

    def args(self) -> list[str]:
        return ["--burden", f"{self.request_ms:.4f}", f"{self.op_ms:.4f}"]


def spin(ms: float) -> None:
    """Spend `ms` of this thread's CPU time (not wall time: a preempted spin still costs what it says)."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


def burn_forever() -> None:
    """The burner process: for each line `request_id ms` on stdin, spin `ms` and answer the request id."""
    for text in sys.stdin:
        request_id, ms = text.split()
        spin(float(ms))
        sys.stdout.write(request_id + "\n")
        sys.stdout.flush()


class StandIn:
    """The floor: a Tinker server whose every future is resolved when it is accepted, kept in a dict. With a
    `Burden`, its training ops resolve when the burner has spent their CPU."""

    def __init__(self, burden: Burden | None = None) -> None:
        self.results: dict[str, Any] = {}
        self.counter = 0
        self.non_2xx = 0
        self.requests = 0
        self.burden = burden
        self.burning: dict[str, asyncio.Future[None]] = {}

    async def _start_burner(self) -> None:
        self.burner = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--burner", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self._burnt = asyncio.create_task(self._read_burnt())  # held: the loop keeps only weak references to tasks

    async def _read_burnt(self) -> None:
        assert self.burner.stdout is not None
        async for text in self.burner.stdout:
            done = self.burning.pop(text.decode().strip(), None)
            if done is not None:
                done.set_result(None)

    def _burn(self, reply: dict[str, Any]) -> dict[str, Any]:
        if self.burden is not None:
            assert self.burner.stdin is not None
            self.burning[reply["request_id"]] = asyncio.get_running_loop().create_future()
            self.burner.stdin.write(f"{reply['request_id']} {self.burden.op_ms}\n".encode())
        return reply

    def _future(self, result: Any, **extra: Any) -> dict[str, Any]:
        self.counter += 1
        request_id = f"f{self.counter}"
        self.results[request_id] = result
        return {"request_id": request_id, **extra}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                if kind == "lifespan.startup" and self.burden is not None:
                    await self._start_burner()
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        self.requests += 1
        if self.burden is not None:
            spin(self.burden.request_ms)
            if scope["path"].endswith("/retrieve_future"):
                burning = self.burning.get(json.loads(body)["request_id"])
                if burning is not None:
                    await burning
        try:
            status, payload, media_type = self.answer(scope["method"], scope["path"], body, headers)
        except Exception as exc:  # noqa: BLE001 - a stand-in bug shows as a 500 the benchmark counts
            status, payload, media_type = 500, json.dumps({"error": repr(exc)}).encode(), "application/json"
        if status >= 300:
            self.non_2xx += 1
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", media_type.encode()),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    def answer(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
        route = path.removeprefix("/api/v1")
        if route == "/retrieve_future":
            return self.retrieve(json.loads(body)["request_id"], PROTOBUF in headers.get("accept", ""))
        if route == "/forward_backward":
            return 200, self.forward_backward(body, headers), "application/json"
        reply = self.json_route(method, route, json.loads(body) if body else {})
        if reply is None:
            return 404, b'{"detail": "not served by the stand-in"}', "application/json"
        return 200, json.dumps(reply).encode(), "application/json"

    def json_route(self, method: str, route: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if route == "/client/config":  # the SDK's flags as Twinkle sends them, so both use the same transport
            return sdk_flags()
        if route == "/client/dynamic_config":
            return {}
        if route == "/create_session":
            self.counter += 1
            return {"type": "create_session", "session_id": f"s{self.counter}"}
        if route == "/session_heartbeat":
            return {"type": "session_heartbeat"}
        if route == "/telemetry":
            return {"status": "accepted"}
        if route == "/create_model":
            model_id = f"{body['session_id']}:train:{body.get('model_seq_id', 0)}"
            return self._future({"model_id": model_id, "type": "create_model"}, model_id=model_id)
        if route == "/get_info":
            return {"type": "get_info", "model_id": body["model_id"], "model_data": {"model_name": BASE_MODEL},
                    "is_lora": True, "lora_rank": 8, "model_name": BASE_MODEL}
        if route == "/optim_step":
            return self._burn(self._future({"type": "optim_step", "metrics": {"grad_norm:mean": 0.0}},
                                           model_id=body["model_id"]))
        if route == "/create_sampling_session":
            return {"type": "create_sampling_session",
                    "sampling_session_id": f"{body['session_id']}:sample:{body.get('sampling_session_seq_id', 0)}"}
        if route == "/asample":
            return self.sample(body)
        if route.startswith("/sessions/") and route.endswith("/finish"):
            return {}
        if route == "/healthz" and method == "GET":
            return {"status": "ok", "requests": self.requests, "non_2xx": self.non_2xx}
        return None

    def forward_backward(self, body: bytes, headers: dict[str, str]) -> bytes:
        meta, batch, _ = decode_forward_backward(body, headers.get("content-type", ""),
                                                 headers.get("content-encoding"), max_bytes=64 << 20)
        outputs = []
        for datum in batch.data:
            shape = np.shape(datum.loss_fn_inputs["target_tokens"])
            outputs.append({"logprobs": np.full(shape, -1.0, np.float32),
                            "elementwise_loss": np.ones(shape, np.float32)})
        result = ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": float(len(batch.data))})
        return json.dumps(self._burn(self._future(result, model_id=meta.model_id))).encode()

    def sample(self, body: dict[str, Any]) -> dict[str, Any]:
        max_tokens = int((body.get("sampling_params") or {}).get("max_tokens") or 16)
        prompt = sum(len(chunk.get("tokens", ())) for chunk in body["prompt"]["chunks"])
        sequences = [SampledSequence(tokens=[3 + i % 50 for i in range(max_tokens)], logprobs=[-1.0] * max_tokens,
                                     stop_reason="length") for _ in range(int(body.get("num_samples", 1)))]
        reply = self._future(SampleOutput(sequences=sequences, prompt_length=prompt))
        reply["sample_sequence_ids"] = [f"{reply['request_id']}:{i}" for i in range(len(sequences))]
        return reply

    def retrieve(self, request_id: str, wants_proto: bool) -> tuple[int, bytes, str]:
        result = self.results.pop(request_id, None)
        if result is None:
            return 404, b'{"detail": "unknown future"}', "application/json"
        if isinstance(result, ForwardBackwardOutput) and wants_proto:
            return 200, encode_forward_backward_output(result), PROTOBUF
        if isinstance(result, SampleOutput) and wants_proto:
            return 200, encode_sample_output(result, result.prompt_length), PROTOBUF
        return 200, json.dumps(result).encode(), "application/json"


def serve_stand_in(port: int, burden: Burden | None) -> None:
    import uvicorn

    # Twinkle's API runs on the same uvicorn settings (api/__main__.py): uvloop and httptools when installed.
    uvicorn.run(StandIn(burden), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                timeout_keep_alive=75)


class StandInServer:
    def __init__(self, log: Path, burden: Burden | None = None) -> None:
        self.port = free_port()
        self.log = log.open("w")
        self.burden = burden

    def start(self) -> None:
        burden = self.burden.args() if self.burden is not None else []
        self.proc = subprocess.Popen([sys.executable, __file__, "--stand-in", str(self.port), *burden], stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.base_url}/api/v1/healthz", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the stand-in did not start")

    def non_2xx(self) -> int:
        return int(httpx.get(f"{self.base_url}/api/v1/healthz", timeout=5).json()["non_2xx"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class TwinkleServer(BenchServer):
    """`twinkle-server launch` of one mock-backend pool on the tiny model, on its embedded broker."""

    def __init__(self, workdir: Path, model_dir: Path) -> None:
        super().__init__(workdir, "sdk-floor", one_pool_config(workdir, model_dir, free_port()))
        self.log_path = workdir / "server.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def non_2xx(self) -> int:
        """Answers of status >= 400 so far, from the access-log lines the launch wrote."""
        text = self.log_path.read_text(errors="replace")
        return len(re.findall(r"(?:GET|POST|PUT|DELETE) \S+ ([45]\d\d) \d", text))

    def broker(self) -> redis.Redis:
        """The launch's embedded broker (its port is on the Valkey process's command line)."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = " ".join(child.cmdline())  # Valkey retitles itself "valkey-server 127.0.0.1:PORT"
            port = re.search(r"valkey-server.*?(?:--port |127\.0\.0\.1:)(\d+)", cmd)
            if port:
                return redis.Redis(host="127.0.0.1", port=int(port.group(1)))
        raise RuntimeError("no embedded broker under the launch")


# -- the SDK benchmark --------------------------------------------------------------------------------------


@dataclass
class Counts:
    errors: int = 0
    timeouts: int = 0
    first_error: str = ""

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, TimeoutError):
            self.timeouts += 1
        else:
            self.errors += 1
        self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"[:300]


@dataclass
class Figures:
    step_ms: list[float] = field(default_factory=list)
    steps_per_s: float = 0.0
    sample_ms: list[float] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    non_2xx: int = 0
    cpu_ms_per_step: dict[str, float] = field(default_factory=dict)  # by process, over the 16-client window
    cpu_ms_per_single_step: dict[str, float] = field(default_factory=dict)  # by process, one client stepping


class CpuMeter:
    """CPU time (user + system) that each process of a server, and this benchmark's own process (the SDK
    clients), spends over a window. With every process on the same cores, the sum per step bounds the
    aggregate: `cores / CPU per step` steps per second at best."""

    def __init__(self, server: psutil.Process) -> None:
        self.server = server

    def processes(self) -> dict[str, list[psutil.Process]]:
        groups: dict[str, list[psutil.Process]] = {"client": [psutil.Process()]}
        for proc in [self.server, *self.server.children(recursive=True)]:
            groups.setdefault(self.role(proc), []).append(proc)
        return groups

    @staticmethod
    def role(proc: psutil.Process) -> str:
        cmd = " ".join(proc.cmdline())
        for role, mark in (("burner", "--burner"), ("stand-in", "--stand-in"), ("api", "-m api"),
                           ("worker", "-m workers"), ("broker", "valkey-server")):
            if mark in cmd:
                return role
        return "launcher"

    @staticmethod
    def seconds(procs: list[psutil.Process]) -> float:
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total

    def start(self) -> None:
        self.groups = self.processes()
        self.before = {role: self.seconds(procs) for role, procs in self.groups.items()}

    def ms_per_step(self, steps: int) -> dict[str, float]:
        return {role: (self.seconds(procs) - self.before[role]) * 1000 / max(steps, 1)
                for role, procs in self.groups.items()}


def batch() -> list[Any]:
    from tinker import types

    data = []
    for d in range(DATUMS):
        tokens = [(7 * i + 13 * d) % 400 + 3 for i in range(TOKENS + 1)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * TOKENS}))
    return data


class Target:
    """One server as the SDK sees it: a training client for the step, 16 more for the aggregate, a sampler."""

    def __init__(self, name: str, base_url: str, clients: int, timeout: float) -> None:
        import tinker

        self.name = name
        self.timeout = timeout
        self.batch = batch()

        def training_client(i: int) -> Any:
            service = tinker.ServiceClient(base_url=base_url, api_key=f"tml-sdk-floor-{name}-{i}")
            return service, service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()

        self.service, self.trainer = training_client(0)
        self.others = [training_client(i + 1)[1] for i in range(clients)]
        self.sampler = self.service.create_sampling_client(base_model=BASE_MODEL).result()

    def step(self, trainer: Any) -> None:
        from tinker import types

        fb = trainer.forward_backward(self.batch, "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result(timeout=self.timeout)
        opt.result(timeout=self.timeout)

    def sample(self) -> None:
        from tinker import types

        self.sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7, 8]), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=16, temperature=1.0)
                            ).result(timeout=self.timeout)


def timed(call: Callable[[], None], n: int, warmup: int, counts: Counts, cpu: CpuMeter | None = None) -> list[float]:
    for _ in range(warmup):
        _guarded(call, counts)
    if cpu is not None:
        cpu.start()
    ms = []
    for _ in range(n):
        started = time.perf_counter()
        if _guarded(call, counts):
            ms.append((time.perf_counter() - started) * 1000)
    return ms


def _guarded(call: Callable[[], None], counts: Counts) -> bool:
    try:
        call()
        return True
    except Exception as exc:  # noqa: BLE001 - counted and shown, never hidden
        counts.failed(exc)
        return False


def aggregate(target: Target, seconds: float, counts: Counts, cpu: CpuMeter) -> tuple[float, dict[str, float]]:
    """Steps per second of the 16 clients together, and the CPU milliseconds per step each process spent."""
    done = [0] * len(target.others)
    window = [0.0, 0.0]  # start, stop: set as the barrier opens, before any thread reads it

    def open_window() -> None:
        cpu.start()
        window[0] = time.perf_counter()
        window[1] = window[0] + seconds

    go = threading.Barrier(len(target.others) + 1, action=open_window)

    def run(i: int) -> None:
        trainer = target.others[i]
        _guarded(lambda: target.step(trainer), counts)  # warm: connections open, first op in
        go.wait()
        while time.perf_counter() < window[1]:
            if _guarded(lambda: target.step(trainer), counts):
                done[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(target.others))]
    for thread in threads:
        thread.start()
    go.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - window[0]
    return sum(done) / elapsed, cpu.ms_per_step(sum(done))


def measure(target: Target, non_2xx: Callable[[], int], cpu: CpuMeter, steps: int, seconds: float,
            samples: int) -> Figures:
    figures = Figures()
    before = non_2xx()
    figures.step_ms = timed(lambda: target.step(target.trainer), steps, 20, figures.counts, cpu)
    figures.cpu_ms_per_single_step = cpu.ms_per_step(len(figures.step_ms))
    figures.steps_per_s, figures.cpu_ms_per_step = aggregate(target, seconds, figures.counts, cpu)
    figures.sample_ms = timed(target.sample, samples, 20, figures.counts)
    figures.non_2xx = non_2xx() - before
    return figures


def line(name: str, f: Figures) -> str:
    return (f"  {name:<8} step p50 {pct(f.step_ms, 50):6.2f} ms  p99 {pct(f.step_ms, 99):6.2f} ms (n={len(f.step_ms)})"
            f" | 16 clients {f.steps_per_s:6.1f} steps/s | sample p50 {pct(f.sample_ms, 50):6.2f} ms"
            f"  p99 {pct(f.sample_ms, 99):6.2f} ms (n={len(f.sample_ms)})"
            f" | {failures(f)}\n{cpu_line('1 client', f.cpu_ms_per_single_step)}"
            f"\n{cpu_line('16 clients', f.cpu_ms_per_step)}")


def failures(f: Figures) -> str:
    c = f.counts
    return (f"errors {c.errors}, timeouts {c.timeouts}, non-2xx {f.non_2xx}"
            + (f"\n           first error: {c.first_error}" if c.first_error else ""))


def cpu_line(who: str, ms: dict[str, float]) -> str:
    parts = ", ".join(f"{role} {value:.2f}" for role, value in ms.items())
    total = sum(ms.values())
    return (f"           CPU ms per step, {who}: {parts} = {total:.2f} ms; "
            f"{CORES} cores allow <= {CORES * 1000 / total:.0f} steps/s" if total else "")


def ceiling(floor: Figures, twinkle: Figures) -> str:
    """What the cores leave for the 16-client target: the SDK clients' own CPU per step is the same against
    either server, so a server reaches 0.8x the floor only if its own CPU per step fits in what remains."""
    client = twinkle.cpu_ms_per_step.get("client", 0.0)
    server = sum(twinkle.cpu_ms_per_step.values()) - client
    target = 0.8 * floor.steps_per_s
    per_step = CORES * 1000 / target
    budget = per_step - client
    return (f"  ceiling  0.8x the floor is {target:.0f} steps/s: {CORES} cores give each step {per_step:.2f} CPU ms, "
            f"the SDK clients take {client:.2f}, leaving {budget:.2f} ms for the server, which spent "
            f"{server:.2f} ms ({server / budget:.1f}x)" if budget > 0 else
            f"  ceiling  0.8x the floor is {target:.0f} steps/s: the SDK clients alone take {client:.2f} CPU ms per "
            f"step, more than {CORES} cores give a step at that rate")


def ratios(floor: Figures, twinkle: Figures) -> str:
    step = pct(twinkle.step_ms, 50) / pct(floor.step_ms, 50)
    rate = twinkle.steps_per_s / floor.steps_per_s
    sample = pct(twinkle.sample_ms, 50) / pct(floor.sample_ms, 50)
    ok = lambda met: "met" if met else "NOT MET"  # noqa: E731
    return (f"  ratios   step p50 {step:.2f}x (<= 1.6x: {ok(step <= 1.6)}) | 16 clients {rate:.2f}x "
            f"(>= 0.8x: {ok(rate >= 0.8)}) | sample p50 {sample:.2f}x (<= 2x: {ok(sample <= 2.0)})")


def merged(rounds: list[Figures]) -> Figures:
    out = Figures()
    out.cpu_ms_per_step = {role: statistics.mean(f.cpu_ms_per_step.get(role, 0.0) for f in rounds)
                           for role in rounds[0].cpu_ms_per_step}
    out.cpu_ms_per_single_step = {role: statistics.mean(f.cpu_ms_per_single_step.get(role, 0.0) for f in rounds)
                                  for role in rounds[0].cpu_ms_per_single_step}
    for f in rounds:
        out.step_ms += f.step_ms
        out.sample_ms += f.sample_ms
        out.counts.errors += f.counts.errors
        out.counts.timeouts += f.counts.timeouts
        out.counts.first_error = out.counts.first_error or f.counts.first_error
        out.non_2xx += f.non_2xx
    out.steps_per_s = statistics.mean(f.steps_per_s for f in rounds)
    return out


# -- the burdened floor -------------------------------------------------------------------------------------


def burdens(floor: Figures, twinkle: Figures, scales: list[float]) -> list[tuple[float, Burden]]:
    """Burdens under which the stand-in's server CPU a step is its own plus `scale` times what Twinkle's server
    spent beyond it in the 16-client windows: the API's excess over a step's four requests, the pool worker's,
    broker's and launcher's over its two ops. Scale 1 costs what Twinkle costs, without its queue and hops."""
    spent = twinkle.cpu_ms_per_step
    request_ms = max(0.0, spent.get("api", 0.0) - floor.cpu_ms_per_step.get("stand-in", 0.0)) / 4
    op_ms = sum(ms for role, ms in spent.items() if role not in ("client", "api")) / 2
    return [(scale, Burden(scale * request_ms, scale * op_ms)) for scale in scales]


def burdened(work: Path, burden: Burden, ns: argparse.Namespace) -> Figures:
    """The step and the 16-client rate through a stand-in carrying `burden`, after its own warm-up."""
    server = StandInServer(work / "burdened.log", burden)
    server.start()
    try:
        target = Target("burdened", server.base_url, ns.clients, ns.timeout)
        cpu = CpuMeter(psutil.Process(server.proc.pid))
        warm = Counts()
        if ns.warmup > 0:
            aggregate(target, ns.warmup, warm, cpu)
        figures = measure(target, server.non_2xx, cpu, ns.steps, ns.seconds, samples=0)
        figures.counts.errors += warm.errors
        figures.counts.timeouts += warm.timeouts
        figures.counts.first_error = warm.first_error or figures.counts.first_error
        return figures
    finally:
        server.stop()


def burdened_line(scale: float, f: Figures, floor: Figures, twinkle: Figures) -> str:
    server = lambda figures: sum(ms for role, ms in figures.cpu_ms_per_step.items() if role != "client")  # noqa: E731
    return (f"  burdened x{scale:.2f}: server {server(f):.2f} CPU ms a step (Twinkle's {server(twinkle):.2f}) | step "
            f"p50 {pct(f.step_ms, 50):6.2f} ms ({pct(f.step_ms, 50) / pct(floor.step_ms, 50):.2f}x the floor) | "
            f"16 clients {f.steps_per_s:6.1f} steps/s ({f.steps_per_s / floor.steps_per_s:.2f}x the floor) | "
            f"{failures(f)}\n{cpu_line('16 clients', f.cpu_ms_per_step)}")


# -- the per-op trace ---------------------------------------------------------------------------------------


def sdk_polls() -> dict[str, tuple[float, float]]:
    """From now on, when the SDK sent each future's latest `retrieve_future` and when its answer arrived, by request
    id (a wrapper around the SDK's private fetch: this benchmark's trace only). A negative "sent, after finished"
    is a poll that waited parked for the op to finish."""
    from tinker.lib import api_future_impl

    polls: dict[str, tuple[float, float]] = {}
    fetch = api_future_impl._APIFuture._fetch_via_rest

    async def timed(self: Any, state: Any, iteration: int) -> Any:
        sent = time.time()
        outcome = await fetch(self, state, iteration)
        polls[self.request_id] = (sent, time.time())
        return outcome

    api_future_impl._APIFuture._fetch_via_rest = timed  # type: ignore[method-assign]
    return polls


def trace(target: Target, server: TwinkleServer, n: int) -> None:
    """Where a Twinkle step's and a sample's time goes, op by op: the SDK's clock next to the future records' own
    times (the API accepted it, the pool worker began and finished it), one machine, one clock. The step's two ops
    are its owner's latest two futures (the console's list), a sample its latest one."""
    from tinker import types

    from twinkle.auth import tenant_id
    from twinkle.keys import Keys

    r = server.broker()
    keys = Keys()
    latest = keys.owner_futures(tenant_id(f"tml-sdk-floor-{target.name}-0"))
    stages: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        stages.setdefault(name, []).append(seconds * 1000)

    polls = sdk_polls()
    for _ in range(n):
        t0 = time.time()
        fb = target.trainer.forward_backward(target.batch, "cross_entropy")
        opt = target.trainer.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result(timeout=target.timeout)
        t_fb = time.time()
        opt.result(timeout=target.timeout)
        t_end = time.time()
        ids = [rid.decode() for rid in r.zrange(latest, -2, -1)]
        records = [{k: float(v) for k, v in zip(("created_at", "started_at", "finished_at"),
                                                          r.hmget(keys.future(rid), "created_at", "started_at",
                                                                  "finished_at"), strict=True) if v}
                   for rid in ids]
        if len(records) != 2 or any(len(rec) != 3 for rec in records):
            continue
        f, o = records
        add("step, as the SDK waits", t_end - t0)
        add("fb: SDK call -> API accepted", f["created_at"] - t0)
        add("fb: accepted -> worker began", f["started_at"] - f["created_at"])
        add("fb: worker ran it", f["finished_at"] - f["started_at"])
        add("fb: worker finished -> SDK result", t_fb - f["finished_at"])
        add("optim: accepted after fb accepted", o["created_at"] - f["created_at"])
        add("optim: accepted -> worker began", o["started_at"] - o["created_at"])
        add("optim: worker ran it", o["finished_at"] - o["started_at"])
        add("optim: worker finished -> SDK result", t_end - o["finished_at"])
        for op, record, t_result, rid in (("fb", f, t_fb, ids[0]), ("optim", o, t_end, ids[1])):
            if rid in polls:
                sent, answered = polls[rid]
                add(f"{op}: answering poll sent, after finished", sent - record["finished_at"])
                add(f"{op}: its answer at the SDK, after finished", answered - record["finished_at"])
                add(f"{op}: answer at the SDK -> SDK result", t_result - answered)
    for _ in range(n):
        t0 = time.time()
        target.sample()
        t_end = time.time()
        [rid] = [rid.decode() for rid in r.zrange(latest, -1, -1)]
        times = r.hmget(keys.future(rid), "created_at", "started_at", "finished_at")
        if not all(times):
            continue
        created, started, finished = (float(t) for t in times if t is not None)
        add("sample, as the SDK waits", t_end - t0)
        add("sample: SDK call -> API accepted", created - t0)
        add("sample: accepted -> worker began", started - created)
        add("sample: worker ran it", finished - started)
        add("sample: worker finished -> SDK result", t_end - finished)
        if rid in polls:
            sent, answered = polls[rid]
            add("sample: answering poll sent, after finished", sent - finished)
            add("sample: its answer at the SDK, after finished", answered - finished)
    count = len(stages.get("step, as the SDK waits", []))
    print(f"\nTwinkle step and sample, op by op (median of {count} steps and "
          f"{len(stages.get('sample, as the SDK waits', []))} samples):")
    for name, ms in stages.items():
        print(f"  {name:<45} {statistics.median(ms):7.2f} ms")


def sdk_requests() -> list[tuple[str, float, float]]:
    """From now on, every HTTP request the SDK sends: (its path's last segment, sent, answered) in perf_counter
    seconds (a wrapper around httpx's AsyncClient.send, which both servers pay alike: this benchmark's trace only)."""
    exchanges: list[tuple[str, float, float]] = []
    send = httpx.AsyncClient.send

    async def timed(self: httpx.AsyncClient, request: httpx.Request, *args: Any, **kwargs: Any) -> httpx.Response:
        sent = time.perf_counter()
        response = await send(self, request, *args, **kwargs)
        exchanges.append((request.url.path.rsplit("/", 1)[-1], sent, time.perf_counter()))
        return response

    httpx.AsyncClient.send = timed  # type: ignore[method-assign]
    return exchanges


STEP_REQUESTS = {"forward_backward": "fb submit", "optim_step": "optim submit"}
POLLS = ("fb poll", "optim poll")  # a step's retrieve_future requests in the order sent: the fb's future is first


def request_trace(targets: dict[str, Target], n: int, block: int = 10) -> None:
    """The four requests of a step as the SDK sends them, each server's next to the other's: when each was sent and
    answered, from the step's start. The servers take turns every `block` steps, so the host's drift falls on both."""
    exchanges = sdk_requests()
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in targets}
    for start in range(0, n, block):
        for name, target in targets.items():
            for _ in range(min(block, n - start)):
                exchanges.clear()
                began = time.perf_counter()
                target.step(target.trainer)
                took = time.perf_counter() - began
                stages = seen[name]
                stages.setdefault("step", []).append(took * 1000)
                polls = iter(POLLS)
                for route, sent, answered in sorted(exchanges, key=lambda exchange: exchange[1]):
                    label = STEP_REQUESTS.get(route) or (next(polls, "later poll") if route == "retrieve_future"
                                                         else None)
                    if label is None:  # the SDK's heartbeat or telemetry, now and then
                        continue
                    for what, ms in (("sent", sent - began), ("answered", answered - began),
                                     ("took", answered - sent)):
                        stages.setdefault(f"{label} {what}", []).append(ms * 1000)
    names = list(targets)
    print(f"\nThe SDK's requests of a step, from the step's start (median of {n} steps each, the servers taking turns "
          f"every {block}):")
    print("  " + " " * 28 + "".join(f"{name:>10}" for name in names))
    for stage in seen[names[-1]]:
        print(f"  {stage:<28}" + "".join(f"{statistics.median(seen[name].get(stage, [float('nan')])):10.2f}"
                                         for name in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="floor, Twinkle alternations")
    parser.add_argument("--steps", type=int, default=200, help="timed single-client steps per round")
    parser.add_argument("--seconds", type=float, default=10.0, help="16-client window per round")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--samples", type=int, default=200, help="timed samples per round")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a result may take")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds each server's 16 clients step before round 1, not counted")
    parser.add_argument("--trace", type=int, default=0, help="Twinkle steps to follow op by op at the end")
    parser.add_argument("--only", choices=("floor", "twinkle"), help="measure one server (profiling)")
    parser.add_argument("--burdened", default="", metavar="SCALES",
                        help="after the rounds, a stand-in burdened with Twinkle's measured server CPU a step times "
                             "each of these comma-separated scales (e.g. 1,0.75,0.5)")
    parser.add_argument("--stand-in", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--burden", type=float, nargs=2, metavar=("REQUEST_MS", "OP_MS"), help=argparse.SUPPRESS)
    parser.add_argument("--burner", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.burner:
        burn_forever()
        return
    if ns.stand_in:
        serve_stand_in(ns.stand_in, Burden(*ns.burden) if ns.burden else None)
        return
    os.environ.setdefault("TINKER_LOG", "error")
    from twinkle.tiny_model import ensure_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = ensure_tiny_model(work / BASE_MODEL)
        stand_in = StandInServer(work / "stand-in.log")
        twinkle = TwinkleServer(work, model)
        stand_in.start()
        twinkle.start()
        try:
            targets = {}
            if ns.only != "twinkle":
                targets["floor"] = (Target("floor", stand_in.base_url, ns.clients, ns.timeout), stand_in.non_2xx,
                                    CpuMeter(psutil.Process(stand_in.proc.pid)))
            if ns.only != "floor":
                targets["twinkle"] = (Target("twinkle", twinkle.base_url, ns.clients, ns.timeout), twinkle.non_2xx,
                                      CpuMeter(psutil.Process(twinkle.proc.pid)))
            print(f"SDK 0.38 against the stand-in floor and Twinkle (mock backend); {DATUMS} x {TOKENS} tokens per "
                  f"forward_backward; load average {os.getloadavg()[0]:.2f} at start", flush=True)
            for name, (target, _, cpu) in targets.items() if ns.warmup > 0 else ():
                warm = Counts()
                rate, _ = aggregate(target, ns.warmup, warm, cpu)
                print(f"  warm-up  {name:<8} 16 clients {rate:6.1f} steps/s for {ns.warmup:g} s, not counted"
                      f" | errors {warm.errors}, timeouts {warm.timeouts}", flush=True)
            results: dict[str, list[Figures]] = {name: [] for name in targets}
            for index in range(ns.rounds):
                print(f"round {index + 1}", flush=True)
                for name, (target, non_2xx, cpu) in targets.items():
                    figures = measure(target, non_2xx, cpu, ns.steps, ns.seconds, ns.samples)
                    results[name].append(figures)
                    print(line(name, figures), flush=True)
                if len(targets) == 2:
                    print(ratios(results["floor"][-1], results["twinkle"][-1]), flush=True)
            print(f"all rounds (steps/s: mean of rounds; load average {os.getloadavg()[0]:.2f} at the end)")
            total = {name: merged(rounds) for name, rounds in results.items()}
            for name, figures in total.items():
                print(line(name, figures))
            if len(total) == 2:
                print(ratios(total["floor"], total["twinkle"]))
                print(ceiling(total["floor"], total["twinkle"]))
                scales = [float(scale) for scale in ns.burdened.split(",") if scale.strip()]
                if scales:
                    print("the floor burdened with Twinkle's server CPU a step (16-client windows, all rounds)",
                          flush=True)
                for scale, burden in burdens(total["floor"], total["twinkle"], scales):
                    print(burdened_line(scale, burdened(work, burden, ns), total["floor"], total["twinkle"]),
                          flush=True)
            if ns.trace and "twinkle" in targets:
                trace(targets["twinkle"][0], twinkle, ns.trace)
                request_trace({name: target for name, (target, _, _) in targets.items()}, ns.trace)
        finally:
            twinkle.stop()
            stand_in.stop()


if __name__ == "__main__":
    main()
