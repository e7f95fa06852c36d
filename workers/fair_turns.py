"""Fair share on one thread: a model pool without clock cycles runs the ops it holds one at a time, each time
the one fair share picks, on the pool's single task thread.

The pool's consumer (workers/op_consumer.py) offers each message here in queue order as it takes it, and takes
one turn whenever it runs an op. Each turn runs the op fair share picks among those held at that moment
(`workers.fair_share`): the first held op of each adapter is a candidate, and the candidate of the least-served
tenant goes. One turn per offer, so every held op runs once, and since one op runs at a time an adapter's first
held op is always free to run.

The clock (`workers.clock`) makes the same choice with a thread per held op and a thread of its own that runs
them, handing every op over twice; here nothing is handed over. The clock remains for fused cycles and for pools
whose tasks take Celery's own path.

Each op's tenant, weight and cost come from the read its delivery made (workers/prereads.py); an op without one
(its read failed, its thread will read for itself) is charged the least cost under no tenant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twinkle import blobs
from twinkle.futures import Op
from workers.fair_share import MIN_OP_COST, FairShare, op_cost
from workers.prereads import Prereads

COSTED_OPS = (Op.FORWARD, Op.FORWARD_BACKWARD, Op.SAMPLE)  # whose cost needs the payload (fair_share.op_cost)


@dataclass
class Turn:
    """One held op: what runs it, and what fair share knows of it once it is classified."""

    run: Callable[[], Any]
    request_id: str
    model_id: str
    arrival: int = 0
    tenant: str = ""
    weight: float = 1.0
    cost: float = MIN_OP_COST
    classified: bool = False

    @property
    def key(self) -> str:
        """Ops with the same key keep their order: the model, or the op itself when it has none."""
        return self.model_id or self.request_id


class FairTurns:
    """The held ops and the fair share between their tenants; used by the pool's consumer thread alone."""

    def __init__(self, prereads: Prereads) -> None:
        self.prereads = prereads
        self.share = FairShare()
        self._held: list[Turn] = []
        self._waiting: Counter[str] = Counter()  # classified held ops per tenant
        self._arrivals = 0

    def offer(self, turn: Turn) -> None:
        """A delivered op, in queue order."""
        self._arrivals += 1
        turn.arrival = self._arrivals
        self._held.append(turn)

    def next(self) -> Turn:
        """The op to run now, charged to its tenant (once per offer)."""
        for turn in self._held:
            if not turn.classified:
                self._classify(turn)
        seen: set[str] = set()
        best: Turn | None = None
        for turn in self._held:
            if turn.key in seen:
                continue
            seen.add(turn.key)
            if best is None or self.share.order_key(turn.tenant, turn.arrival) < self.share.order_key(
                    best.tenant, best.arrival):
                best = turn
        if best is None:
            raise LookupError("a turn with no op held: each offer is followed by exactly one turn")
        self.share.charge(best.tenant, best.cost, best.weight)
        self._forget(best)
        return best

    def __len__(self) -> int:
        return len(self._held)

    def _classify(self, turn: Turn) -> None:
        inputs = self.prereads.peek(turn.request_id, turn.model_id)
        record = inputs.record if inputs is not None else None
        if record is not None and inputs is not None:
            turn.tenant, turn.weight = record.owner, record.weight or 1.0
            try:
                payload = blobs.loads(inputs.payload) if inputs.payload and record.op in COSTED_OPS else None
                turn.cost = op_cost(record.op, payload)
            except Exception:  # noqa: BLE001 - a payload the op itself will refuse, with its own error, when it runs
                turn.cost = MIN_OP_COST
        if not self._waiting[turn.tenant]:  # it starts waiting: idle time is no credit (FairShare.lift)
            self.share.lift(turn.tenant)
            self.share.forget_idle(self._waiting)  # the tenants with ops held
        self._waiting[turn.tenant] += 1
        turn.classified = True

    def _forget(self, turn: Turn) -> None:
        self._held.remove(turn)
        if turn.classified:
            self._waiting[turn.tenant] -= 1
            if not self._waiting[turn.tenant]:
                del self._waiting[turn.tenant]
