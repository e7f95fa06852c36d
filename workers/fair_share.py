"""Weighted fair share between tenants: a Virtual Token Counter (VTC, Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024) kept by each pool process.

Every tenant has a counter of the service it received, in tokens divided by its weight. The pool serves the
waiting tenant with the smallest counter and charges the op it picked. A tenant that starts waiting after an
idle spell is first lifted to the smallest counter among the tenants already waiting, so idling banks no
credit; while nobody else waits it is served at once (work-conserving). So when several tenants wait, each
one's next op runs after at most about one op of every other waiting tenant, whatever their backlogs, and
backlogged tenants of weights 1 and 2 receive tokens in the ratio 1:2.

Counters live in the pool process: a restarted pool starts everyone even. A redelivered op is charged once,
when it is picked again (the crashed process's charges died with it), and keeps its place in delivery order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from twinkle.futures import Op
from twinkle.types import SampleRequest, input_length
from twinkle.usage import batch_tokens

# Ops that process no tokens still hold the pool: they are charged as if they processed this many.
MIN_OP_COST = 16.0
TOKEN_OPS = (Op.FORWARD, Op.FORWARD_BACKWARD)


def op_cost(op: str, payload: Any) -> float:
    """An op's cost in tokens, known before it runs: its input tokens, or for a sample its prompt plus the
    most tokens it may generate."""
    if op in TOKEN_OPS:
        return max(MIN_OP_COST, float(batch_tokens(payload)))
    if op == Op.SAMPLE and isinstance(payload, SampleRequest):
        generated = payload.params.max_tokens * max(1, payload.num_samples)
        return max(MIN_OP_COST, float(input_length(payload.prompt) + generated))
    return MIN_OP_COST


class FairShare:
    """The counters of one pool, and the choice between waiting tenants. Not thread-safe: its owner locks."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.virtual = 0.0  # the start tag of the op picked last: where a newly waiting tenant starts
        self.served: dict[str, float] = {}  # tokens charged per tenant since start (for reports and tests)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def lift(self, tenant: str) -> None:
        """`tenant` starts waiting: bring its counter up to the virtual time, so the time it spent idle is not
        credit it can spend against the tenants that kept waiting."""
        if self.virtual > self.counter(tenant):
            self.counters[tenant] = self.virtual

    def charge(self, tenant: str, cost: float, weight: float = 1.0) -> None:
        """`tenant`'s op of `cost` tokens was picked."""
        start = self.counter(tenant)
        self.virtual = max(self.virtual, start)
        self.counters[tenant] = start + cost / max(weight, 1e-6)
        self.served[tenant] = self.served.get(tenant, 0.0) + cost

    def order_key(self, tenant: str, arrival: int) -> tuple[float, int]:
        """Sort key of a candidate op: its tenant's counter, then delivery order (the older first)."""
        return self.counter(tenant), arrival

    def forget_idle(self, waiting: Iterable[str]) -> None:
        """Drop the counters of tenants with nothing waiting that are at or below the virtual time (lifting
        would restore them anyway), so a pool that served thousands of tenants keeps few."""
        if len(self.counters) < 1024:
            return
        waiting_set = set(waiting)
        for tenant in [t for t, value in self.counters.items() if t not in waiting_set and value <= self.virtual]:
            del self.counters[tenant]
