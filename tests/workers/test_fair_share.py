"""Fair share between tenants: the counters alone, then a real Clock choosing among many tenants' ops.

Clock tests hand every job over before the first cycle (tests.workers.test_clock.Harness), so the order
the backend log shows is the scheduler's choice and nothing else's."""

from __future__ import annotations

import pytest

from tests.workers.test_clock import Harness, batch
from twinkle.futures import Op
from twinkle.types import SampleRequest, SamplingParams, chunks_from_tokens
from workers.fair_share import MIN_OP_COST, FairShare, op_cost


def test_an_ops_cost_is_its_input_tokens_or_a_samples_prompt_and_budget() -> None:
    assert op_cost(Op.FORWARD_BACKWARD, batch(100)) == 100
    sample = SampleRequest(chunks_from_tokens([1] * 20), SamplingParams(max_tokens=30), num_samples=2)
    assert op_cost(Op.SAMPLE, sample) == 20 + 60
    assert op_cost(Op.OPTIM_STEP, None) == MIN_OP_COST


def test_a_tenant_that_starts_waiting_is_lifted_to_the_start_of_the_op_in_service_and_never_lowered() -> None:
    share = FairShare()
    for _ in range(3):
        share.charge("busy", 1000)  # its third op started at 2000 and is in service
    share.lift("idle")
    assert share.counter("idle") == 2000 and share.counter("busy") == 3000  # the newcomer goes next
    share.counters["rich"] = 5000.0
    share.lift("rich")
    assert share.counter("rich") == 5000


def test_weight_divides_the_charge() -> None:
    share = FairShare()
    share.charge("a", 100, weight=1)
    share.charge("b", 100, weight=4)
    assert share.counter("a") == 100 and share.counter("b") == 25
    assert share.served == {"a": 100, "b": 100}


def light_positions(log: list[tuple[str, ...]]) -> list[int]:
    return [index for index, entry in enumerate(log) if entry[1].startswith("light")]


@pytest.mark.parametrize("gather", [False, True])
def test_a_light_tenant_waits_for_at_most_one_op_of_a_heavy_tenants_backlog(gather: bool) -> None:
    h = Harness(gather=gather, max_tokens=4096)
    with h.running():
        for _ in range(8):  # the heavy tenant keeps 8 steps in flight on its adapter
            h.submit(Op.FORWARD_BACKWARD, "heavy", batch(4000), owner="heavy")
            h.submit(Op.OPTIM_STEP, "heavy", owner="heavy")
        for name in ("light1", "light2", "light3", "light4"):
            h.submit(Op.FORWARD_BACKWARD, name, batch(64), owner=name)
    heavy_compute = [index for index, entry in enumerate(h.backend.log) if "heavy" in entry
                     and entry[0] in ("forward_backward", "fused")]
    # every light op ran before the heavy tenant's second forward_backward: it waited for one heavy op at most
    assert max(light_positions(h.backend.log)) < heavy_compute[1]
    assert all(not isinstance(result, Exception) for result in h.results.values())


def test_a_light_tenants_whole_step_runs_before_a_heavy_tenants_next_op() -> None:
    h = Harness(gather=False)
    h.clock.share.charge("heavy", 4000)  # a heavy op is in service as the light step arrives
    with h.running():
        for _ in range(4):
            h.submit(Op.FORWARD_BACKWARD, "heavy", batch(4000), owner="heavy")
        h.submit(Op.FORWARD_BACKWARD, "light", batch(64), owner="light")
        h.submit(Op.OPTIM_STEP, "light", owner="light")
    assert [entry[1] for entry in h.backend.log[:2]] == ["light", "light"]


def test_an_adapters_ops_keep_their_order_under_fair_share() -> None:
    h = Harness(gather=False)
    with h.running():
        for step in range(6):
            h.submit(Op.FORWARD_BACKWARD if step % 2 == 0 else Op.OPTIM_STEP, "a", batch(500), owner="big")
        for step in range(6):
            h.submit(Op.FORWARD_BACKWARD if step % 2 == 0 else Op.OPTIM_STEP, "b", batch(10), owner="small")
    for adapter in ("a", "b"):
        kinds = [entry[0] for entry in h.backend.log if entry[1] == adapter]
        assert kinds == ["forward_backward", "optim_step"] * 3


def test_backlogged_tenants_get_tokens_in_the_ratio_of_their_weights() -> None:
    h = Harness(gather=False)
    with h.running():
        for _ in range(40):
            h.submit(Op.FORWARD, "one", batch(100), owner="one", weight=1)
        for _ in range(40):
            h.submit(Op.FORWARD, "two", batch(100), owner="two", weight=2)
    first = h.backend.log[:30]  # while both are backlogged
    served = {name: sum(1 for entry in first if entry[1] == name) for name in ("one", "two")}
    assert abs(served["two"] - 2 * served["one"]) <= 1, served


def test_a_tenant_back_from_idle_shares_instead_of_spending_banked_credit() -> None:
    h = Harness(gather=False)
    for _ in range(1000):  # "early" has been served alone for a while; "late" was idle
        h.clock.share.charge("early", 100)
    with h.running():
        for _ in range(10):
            h.submit(Op.FORWARD, "early", batch(100), owner="early")
        for _ in range(10):
            h.submit(Op.FORWARD, "late", batch(100), owner="late")
    # without the lift "late" would run its 10 ops first; lifted, the two alternate from the start
    assert [entry[1] for entry in h.backend.log[:6]].count("late") <= 4


def test_a_lone_tenant_is_served_back_to_back() -> None:
    h = Harness(gather=False)
    with h.running():
        for _ in range(12):
            h.submit(Op.FORWARD, "solo", batch(1000), owner="solo")
    assert [entry[1] for entry in h.backend.log] == ["solo"] * 12
    assert h.clock.cycles == 12
