"""Clock cycles: a model pool runs the ready ops of many adapters together.

With the clock on, a model pool holds up to `max_ops` messages at once (one Celery thread each). Each
task thread hands its op to the clock as a `Job` and waits; one clock thread runs cycles:

- a cycle is built from the ops in hand in delivery order (the consumer thread reports each message as it
  is received, `arrived`, so the order is the queue's, i.e. acceptance order). An adapter's op joins only
  if every earlier op of that adapter is in the same cycle or done: one adapter's ops never reorder;
- the oldest runnable op decides the cycle: a fusable forward / forward_backward gathers every other
  runnable fusable one (up to `max_ops` and `max_tokens`) into one fused pass through the base model
  (`FusedRunner`, per-row LoRA); an optim_step gathers the other adapters' ready optim_steps, run back to
  back; anything else (save, load, create, ...) runs alone;
- before a cycle starts it waits up to `window_ms` for ops already delivered but still being read from
  the broker by their threads, so a burst of clients shares one pass.

Every job is begun (future marked running), checked (adapter alive) and run at its turn inside the cycle,
under the pool's lock, and each job's outcome goes back to its own thread, which writes its own future:
one op's error never fails another, and a crash mid-cycle leaves each op's future `running`, which its
redelivery turns into its own `adapter_state_lost` failure, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from twinkle.backends.base import FusedPasses, ResidentSlots
from twinkle.futures import FutureRecord, Op
from twinkle.types import ForwardBackwardInput, input_length
from workers.fair_share import FairShare, op_cost

log = logging.getLogger("twinkle.clock")

COMPUTE_OPS = (Op.FORWARD, Op.FORWARD_BACKWARD)
STALE_SECONDS = 600.0  # a delivered message whose thread never showed up (it cannot: threads >= prefetch)


@dataclass
class Job:
    """One op handed over by its task thread."""

    op: str
    rec: FutureRecord
    payload: Any
    prepare: Callable[[], None]  # marks it running and checks its adapter; raises to fail it
    call: Callable[[], Any]  # runs it alone through the pool's handler
    seconds: float = 0.0  # its share of a fused pass's time, set by the clock (an op run alone times itself)


@dataclass
class _Entry:
    request_id: str
    since: float = field(default_factory=time.monotonic)
    job: Job | None = None
    kind: str = ""  # "fused", "optim" or "single" once the job is in
    tokens: int = 0
    taken: bool = False  # in a cycle; its thread has not left yet, so later ops of its model still wait
    model_id: str = ""  # from the message, before the job is handed over
    cost: float = 0.0  # its fair-share charge, in tokens
    arrival: int = 0  # delivery order
    outcome: Future[Any] = field(default_factory=Future)

    @property
    def tenant(self) -> str:
        return self.job.rec.owner if self.job else ""

    @property
    def key(self) -> str:
        """Ops with the same key keep their order: the model, or the op itself when it has none."""
        return self.model_id or (self.job.rec.model_id if self.job and self.job.rec.model_id else self.request_id)


class FusedRunner:
    """Runs fusable compute jobs of different adapters as one backend pass (backends with `run_fused`)."""

    def __init__(self, backend: Any, after: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.after = after  # what the pool does after every op (publish slot residency), here after a pass

    @staticmethod
    def available(backend: Any) -> bool:
        return isinstance(backend, FusedPasses)

    @staticmethod
    def fusable(job: Job) -> bool:
        """What the op alone says (task threads ask, without touching the backend): a Tinker-style compute
        batch that reads the adapter and no images. Twinkle-native inputs go through their own handler."""
        batch = job.payload
        return (job.op in COMPUTE_OPS and isinstance(batch, ForwardBackwardInput) and not batch.disable_lora
                and not any(datum.images() for datum in batch.data))

    def split(self, jobs: list[Job]) -> tuple[list[Job], list[Job]]:
        """The jobs whose adapters can share a fused pass, and the others (asked at run time, under the pool's
        lock, since the backend may have to page an adapter in to answer)."""
        fused: list[Job] = []
        alone: list[Job] = []
        # A pass needs all its adapters on the device at once: at most the backend's slots of them.
        slots = self.backend.resident_slots if isinstance(self.backend, ResidentSlots) else len(jobs)
        adapters: set[str] = set()
        for job in jobs:
            adapter = job.rec.model_id
            try:
                reason = self.backend.fused_solo_reason(adapter, job.payload)
            except Exception:  # noqa: BLE001 - its own call reports whatever is wrong with it
                reason = "unknown"
            if reason is None and adapter not in adapters and len(adapters) >= slots:
                reason = "no slot left in this pass"
            if reason is None:
                adapters.add(adapter)
            (fused if reason is None else alone).append(job)
        return fused, alone

    def run(self, jobs: list[Job]) -> list[Any]:
        calls = [(job.rec.model_id, job.payload, job.op == Op.FORWARD_BACKWARD) for job in jobs]
        try:
            results: list[Any] = self.backend.run_fused(calls)
        finally:
            if self.after is not None:
                self.after()
        return results


class Clock:
    def __init__(self, lock: Any, running: Callable[[FutureRecord], contextlib.AbstractContextManager[None]],
                 fuser: FusedRunner | None, *, window_ms: float = 5.0, max_ops: int = 16,
                 max_tokens: int = 16384, gather: bool = True, fair: bool = True, hold: int = 0) -> None:
        self.lock = lock
        self.running = running
        self.fuser = fuser
        self.window = window_ms / 1000
        self.max_ops = max_ops
        self.max_tokens = max_tokens
        self.gather = gather  # False: every op runs alone (a pool without clock cycles still schedules fairly)
        self.share = FairShare()
        self.fair = fair  # False: arrival order (scheduling.policy fifo)
        # ops the pool holds to choose from (its Celery threads): at least a cycle's worth
        self.hold = max(hold, max_ops if gather else 1)
        self._arrivals = 0
        self._order: list[_Entry] = []  # delivery order
        self._by_id: dict[str, _Entry] = {}
        self._cond = threading.Condition()
        self.cycles = 0
        self.fused_ops = 0  # ops that ran inside a fused pass of two or more

    def start(self) -> Clock:
        threading.Thread(target=self._loop, name="model-clock", daemon=True).start()
        return self

    # -- task threads ---------------------------------------------------------------------------

    def arrived(self, request_id: str, model_id: str = "") -> None:
        """The consumer received this message (called in queue order, before its thread starts). Its model, from
        the message, holds the model's later ops back until this one is handed over: threads hand over in any
        order."""
        if not request_id:
            return  # not one of ours: nothing will hand it over
        with self._cond:
            self._entry(request_id).model_id = model_id

    def run(self, job: Job) -> Any:
        """Run the job at its turn and return its result (or raise its error), from its own thread."""
        with self._cond:
            entry = self._entry(job.rec.request_id)
            tenant = job.rec.owner
            waiting = {other.tenant for other in self._order if other.job is not None and not other.taken}
            if tenant not in waiting:  # it starts waiting: idle time is no credit (fair_share.FairShare.lift)
                self.share.lift(tenant)
                self.share.forget_idle(waiting)
            entry.job = job
            entry.kind, entry.tokens = self._classify(job)
            entry.cost = op_cost(job.op, job.payload)
            self._cond.notify_all()
        return entry.outcome.result()

    def leave(self, request_id: str) -> None:
        """The message's thread is done with it (completed, failed, or never handed over)."""
        with self._cond:
            entry = self._by_id.pop(request_id, None)
            if entry is not None:
                self._order.remove(entry)
                self._cond.notify_all()

    def _entry(self, request_id: str) -> _Entry:
        entry = self._by_id.get(request_id)
        if entry is None:  # a redelivered duplicate or no `arrived` hook (in-process use): order of hand-over
            self._arrivals += 1
            entry = self._by_id[request_id] = _Entry(request_id, arrival=self._arrivals)
            self._order.append(entry)
        return entry

    def _classify(self, job: Job) -> tuple[str, int]:
        if not self.gather:
            return "single", 0
        if self.fuser is not None and self.fuser.fusable(job):
            batch = job.payload
            width = max((input_length(datum.model_input) for datum in batch.data), default=0)
            return "fused", width * len(batch.data)
        if job.op == Op.OPTIM_STEP:
            return "optim", 0
        return "single", 0

    # -- the clock thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            cycle = self._next_cycle()
            try:
                self._run(cycle)
            except BaseException as error:  # noqa: BLE001 - never leave a waiting thread behind
                for entry in cycle:
                    if not entry.outcome.done():
                        entry.outcome.set_exception(error)

    def _next_cycle(self) -> list[_Entry]:
        with self._cond:
            while True:
                self._drop_stale()
                if any(entry.job is not None and not entry.taken for entry in self._order):
                    deadline = time.monotonic() + self.window
                    while any(entry.job is None for entry in self._order) and time.monotonic() < deadline:
                        self._cond.wait(max(0.0, deadline - time.monotonic()))
                    cycle = self._pick()
                    if cycle:
                        for entry in cycle:
                            entry.taken = True
                        return cycle
                self._cond.wait(1.0)  # run() and leave() notify

    def _pick(self) -> list[_Entry]:
        """The next cycle, chosen by fair share (`workers.fair_share`): the runnable op of the tenant served
        least so far decides the cycle's kind, and the cycle fills with further runnable ops of that kind, each
        time the least-served tenant's first; every pick is charged at once. Runnable: the first op of its
        adapter still waiting, handed over by its thread, with no earlier op of the adapter still running."""
        cycle: list[_Entry] = []
        in_cycle: set[int] = set()
        kind, tokens = "", 0
        while len(cycle) < self.max_ops:
            candidates = [entry for entry in self._heads(in_cycle) if not cycle or (
                entry.kind == kind and (kind != "fused" or tokens + entry.tokens <= self.max_tokens))]
            if not candidates:
                break
            entry = min(candidates, key=lambda e: self.share.order_key(e.tenant, e.arrival) if self.fair
                        else (0.0, e.arrival))
            assert entry.job is not None
            self.share.charge(entry.tenant, entry.cost, entry.job.rec.weight or 1.0)
            cycle.append(entry)
            in_cycle.add(id(entry))
            if len(cycle) == 1:
                kind, tokens = entry.kind, 0
            tokens += entry.tokens
            if kind == "single":
                break
        return cycle

    def _heads(self, in_cycle: set[int]) -> list[_Entry]:
        """The ops that may run next: per adapter (or per op without one), its first op not yet in a cycle, if
        its thread handed it over and no earlier op of the adapter still runs. An op that ran no longer holds its
        adapter back while its thread writes its outcome: otherwise the next pick, made at once, would always pass
        over a backlogged tenant's adapter and serve tenants in turns instead of by their weights."""
        seen: set[str] = set()
        heads: list[_Entry] = []
        for entry in self._order:
            if id(entry) in in_cycle or (entry.taken and entry.outcome.done()):
                continue
            key = entry.key
            if key in seen:
                continue
            seen.add(key)
            if not entry.taken and entry.job is not None:
                heads.append(entry)
        return heads

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for entry in list(self._order):
            if entry.job is None and now - entry.since > STALE_SECONDS:
                log.warning("message %s was delivered but never handed over; no longer waiting for it",
                            entry.request_id)
                self._order.remove(entry)
                self._by_id.pop(entry.request_id, None)

    def _run(self, cycle: list[_Entry]) -> None:
        jobs = [entry.job for entry in cycle if entry.job is not None]
        with self.lock, self.running(jobs[0].rec):
            ready: list[_Entry] = []
            for entry in cycle:
                assert entry.job is not None
                try:
                    entry.job.prepare()
                except BaseException as error:  # noqa: BLE001 - its own failure
                    entry.outcome.set_exception(error)
                    continue
                ready.append(entry)
            alone = ready
            if len(ready) > 1 and cycle[0].kind == "fused" and self.fuser is not None:
                fusable, solo = self.fuser.split([entry.job for entry in ready if entry.job is not None])
                if len(fusable) > 1:
                    # Fusability is a property of the adapter here (dropout, layer kinds), so an adapter's ops
                    # are all fused or all alone, and each keeps its order either way.
                    by_job = {id(entry.job): entry for entry in ready}
                    began = time.perf_counter()
                    try:
                        outcomes = self.fuser.run(fusable)
                    except Exception:
                        # Raised before any compute (a failure inside the pass is each call's own outcome), e.g.
                        # more adapters than slots: nothing ran, so each op can still run alone.
                        log.exception("a fused pass of %d ops failed; running them one at a time", len(fusable))
                        solo = fusable + solo
                        fusable, outcomes = [], []
                    self.fused_ops += len(fusable)
                    _share_time(fusable, [by_job[id(job)].tokens for job in fusable], time.perf_counter() - began)
                    for job, outcome in zip(fusable, outcomes, strict=True):
                        entry = by_job[id(job)]
                        if isinstance(outcome, BaseException):
                            entry.outcome.set_exception(outcome)
                        else:
                            entry.outcome.set_result(outcome)
                    alone = [by_job[id(job)] for job in solo]
            for entry in alone:
                assert entry.job is not None
                try:
                    entry.outcome.set_result(entry.job.call())
                except BaseException as error:  # noqa: BLE001 - its own failure
                    entry.outcome.set_exception(error)
        self.cycles += 1


def _share_time(jobs: list[Job], tokens: list[int], seconds: float) -> None:
    """Each op of a fused pass is charged the pass's time in proportion to its tokens."""
    total = sum(tokens) or len(jobs)
    for job, count in zip(jobs, tokens, strict=True):
        job.seconds = seconds * (count or 1) / total
