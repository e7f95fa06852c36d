"""The clock's cycles: which ops share a pass, in what order, and who gets which outcome.

Each test hands jobs to a real Clock from one thread per job, as the pool's Celery threads do, after
reporting their arrival in queue order, as the pool's consumer does; the backend is a recorder."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from twinkle.errors import InvalidRequest
from twinkle.futures import FutureRecord, Op
from twinkle.types import Datum, ForwardBackwardInput, chunks_from_tokens
from workers.clock import Clock, FusedRunner, Job


class RecordingBackend:
    """Records every call; a fused pass answers each call with (adapter, "fused", pass number)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.passes = 0

    def fused_solo_reason(self, adapter_id: str, batch: ForwardBackwardInput) -> str | None:
        return "dropout" if adapter_id.startswith("solo") else None

    def run_fused(self, calls: list[tuple[str, ForwardBackwardInput, bool]]) -> list[Any]:
        if any(adapter == "no-slot" for adapter, _, _ in calls):
            raise RuntimeError("more adapters than slots")
        self.passes += 1
        self.log.append(("fused", *[adapter for adapter, _, _ in calls]))
        return [(adapter, "fused", self.passes) if adapter != "broken" else InvalidRequest("bad batch")
                for adapter, _, _ in calls]


def batch(tokens: int = 4) -> ForwardBackwardInput:
    return ForwardBackwardInput([Datum(chunks_from_tokens(list(range(1, tokens + 1))),
                                       {"target_tokens": np.arange(2, tokens + 2)})])


class Harness:
    def __init__(self, **options: Any) -> None:
        self.backend = RecordingBackend()
        self.lock = threading.Lock()
        self.clock = Clock(self.lock, lambda rec: contextlib.nullcontext(), FusedRunner(self.backend),
                           **{"window_ms": 1000.0, **options})  # waits only for jobs not yet handed over
        self.results: dict[str, Any] = {}
        self.threads: list[threading.Thread] = []
        self.count = 0

    def submit(self, op: str, model_id: str, payload: Any = None, *, fail_prepare: bool = False, owner: str = "o",
               weight: float = 1.0) -> str:
        self.count += 1
        rid = f"r{self.count}"
        rec = FutureRecord(request_id=rid, op=op, owner=owner, model_id=model_id, queue="q", weight=weight)
        self.clock.arrived(rid)

        def prepare() -> None:
            if fail_prepare:
                raise InvalidRequest("adapter gone")

        def call() -> Any:
            self.backend.log.append((op, model_id))
            return (model_id, op)

        def run() -> None:
            try:
                self.results[rid] = self.clock.run(Job(op, rec, payload, prepare, call))
            except Exception as error:  # noqa: BLE001 - recorded for the test
                self.results[rid] = error
            finally:
                self.clock.leave(rid)

        self.threads.append(threading.Thread(target=run))
        return rid

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Start the job threads while the clock is held back, so every job is in hand at the first cycle."""
        with self.lock:
            yield
            for thread in self.threads:
                thread.start()
            time.sleep(0.05)
            self.clock.start()
        for thread in self.threads:
            thread.join(timeout=10)


def test_ready_compute_ops_of_different_adapters_share_one_pass_in_arrival_order() -> None:
    h = Harness()
    with h.running():
        a = h.submit(Op.FORWARD_BACKWARD, "a", batch())
        b = h.submit(Op.FORWARD, "b", batch())
        c = h.submit(Op.FORWARD_BACKWARD, "c", batch())
    assert h.backend.log == [("fused", "a", "b", "c")]
    assert h.results[a] == ("a", "fused", 1) and h.results[b] == ("b", "fused", 1) and h.results[c] == ("c", "fused", 1)
    assert h.clock.fused_ops == 3


class TwoSlotBackend(RecordingBackend):
    resident_slots = 2


def test_a_pass_takes_no_more_adapters_than_the_backend_holds_at_once() -> None:
    h = Harness()
    h.backend = TwoSlotBackend()
    h.clock.fuser = FusedRunner(h.backend)
    with h.running():
        for adapter in "abc":
            h.submit(Op.FORWARD_BACKWARD, adapter, batch())
    assert ("fused", "a", "b") in h.backend.log and ("fused", "a", "b", "c") not in h.backend.log
    assert ("forward_backward", "c") in h.backend.log or ("fused", "c") in h.backend.log


def test_one_adapters_ops_never_pass_each_other() -> None:
    h = Harness()
    with h.running():
        h.submit(Op.FORWARD_BACKWARD, "a", batch())
        h.submit(Op.OPTIM_STEP, "a")
        h.submit(Op.FORWARD_BACKWARD, "a", batch())  # must wait for a's optim_step
        h.submit(Op.FORWARD_BACKWARD, "b", batch())
        h.submit(Op.OPTIM_STEP, "b")
    assert h.backend.log[0] == ("fused", "a", "b")
    # after that, which adapter goes first depends on which thread hands back first; each keeps its order
    assert [entry for entry in h.backend.log[1:] if entry[1] == "a"] == [("optim_step", "a"),
                                                                         ("forward_backward", "a")]
    assert [entry for entry in h.backend.log[1:] if entry[1] == "b"] == [("optim_step", "b")]


def test_a_save_runs_alone_and_blocks_only_its_own_adapter() -> None:
    h = Harness()
    with h.running():
        h.submit(Op.SAVE_STATE, "a")
        h.submit(Op.FORWARD_BACKWARD, "a", batch())
        h.submit(Op.FORWARD_BACKWARD, "b", batch())
        h.submit(Op.FORWARD_BACKWARD, "c", batch())
    assert h.backend.log == [("save_state", "a"), ("fused", "b", "c"), ("forward_backward", "a")] or \
        h.backend.log == [("save_state", "a"), ("fused", "a", "b", "c")]


def test_each_op_gets_its_own_failure_and_the_others_their_results() -> None:
    h = Harness()
    with h.running():
        gone = h.submit(Op.FORWARD_BACKWARD, "a", batch(), fail_prepare=True)
        broken = h.submit(Op.FORWARD_BACKWARD, "broken", batch())
        fine = h.submit(Op.FORWARD_BACKWARD, "c", batch())
        lone = h.submit(Op.FORWARD_BACKWARD, "d", batch())
    assert isinstance(h.results[gone], InvalidRequest) and "adapter gone" in str(h.results[gone])
    assert isinstance(h.results[broken], InvalidRequest) and "bad batch" in str(h.results[broken])
    assert h.results[fine] == ("c", "fused", 1) and h.results[lone] == ("d", "fused", 1)


def test_unfusable_calls_and_token_budgets_split_passes() -> None:
    h = Harness(max_tokens=10)
    with h.running():
        h.submit(Op.FORWARD_BACKWARD, "solo-dropout", batch())
        h.submit(Op.FORWARD_BACKWARD, "a", batch(6))
        h.submit(Op.FORWARD_BACKWARD, "b", batch(6))  # 6 + 6 tokens > 10
    assert h.backend.log[0] == ("forward_backward", "solo-dropout")
    assert sorted(h.backend.log[1:]) == [("forward_backward", "a"), ("forward_backward", "b")]


@pytest.mark.parametrize("ops", [4, 12])
def test_many_ops_of_one_adapter_run_one_after_another_in_order(ops: int) -> None:
    h = Harness(max_ops=4)
    with h.running():
        for step in range(ops):
            h.submit(Op.OPTIM_STEP if step % 2 else Op.FORWARD_BACKWARD, "a", batch())
    kinds = [entry[0] for entry in h.backend.log]
    assert kinds == ["forward_backward" if step % 2 == 0 else "optim_step" for step in range(ops)]


def test_a_fused_pass_that_cannot_start_runs_its_ops_one_at_a_time() -> None:
    h = Harness()
    with h.running():
        a = h.submit(Op.FORWARD_BACKWARD, "a", batch())
        b = h.submit(Op.FORWARD_BACKWARD, "no-slot", batch())
    assert h.backend.log == [("forward_backward", "a"), ("forward_backward", "no-slot")]
    assert h.results[a] == ("a", "forward_backward") and h.results[b] == ("no-slot", "forward_backward")
