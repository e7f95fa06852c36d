"""Long-polls park in plain ASGI, outside the route: a parked poll holds no route frame and wakes when its
future ends, the long-poll's time is not spent twice, and a poll the middleware cannot read is answered at
once, by the route, as before."""

from __future__ import annotations

import asyncio
import gc
import inspect
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from fastapi.encoders import jsonable_encoder

from api import long_poll
from api.finite_json import FiniteJSONResponse
from api.future_answer import result_answer
from tests.harness import ApiInProcess, api_in_process
from twinkle import blobs
from twinkle.auth import tenant_id
from twinkle.futures import FutureRecord, new_request_id
from twinkle.types import ForwardBackwardOutput, SampledSequence, SampleOutput

KEY = "tml-long-poll"
LONG_POLL_SECONDS = 1.5


@dataclass
class Served(ApiInProcess):

    def queued_future(self, owner_key: str = KEY) -> str:
        """A future no worker runs (its queue has no consumer): only the test ends it."""
        rid = new_request_id()
        record = FutureRecord(request_id=rid, op="save_state", owner=tenant_id(owner_key), model_id="",
                              queue="model.nobody.0", created_at=time.time())
        self.redis.hset(self.keys.future(rid), mapping=record.to_hash())
        return rid

    def complete(self, rid: str) -> None:
        self.redis.set(self.keys.blob_out(rid), blobs.dumps({"path": f"tinker://run/weights/{rid}"}))
        self.redis.hset(self.keys.future(rid), "status", "completed")
        self.redis.publish(self.keys.done_channel(rid), "completed")

    @property
    def parked(self) -> int:
        return int(self.app.state.ctx.hub.pending)

    async def until_parked(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while self.parked < n:
            assert time.monotonic() < deadline, f"{self.parked} of {n} polls parked"
            await asyncio.sleep(0.01)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with api_in_process(KEY, long_poll_seconds=LONG_POLL_SECONDS) as api:
        yield Served(api.http, api.app, api.redis, api.keys)


def route_frames() -> int:
    """Live coroutines of the retrieve_future route (a poll parked in it holds one)."""
    return sum(1 for o in gc.get_objects() if inspect.iscoroutine(o) and o.__qualname__ == "retrieve_future")


async def test_a_parked_poll_holds_no_route_and_answers_the_result_once_its_future_completes(
        served: Served) -> None:
    rid = served.queued_future()
    poll = asyncio.create_task(served.http.post("/retrieve_future", json={"request_id": rid}))
    await served.until_parked(1)
    await asyncio.sleep(0.1)
    assert route_frames() == 0
    assert not poll.done()
    served.complete(rid)
    r = await poll
    assert r.status_code == 200, r.text
    assert r.json() == {"path": f"tinker://run/weights/{rid}", "type": "save_weights"}
    assert served.parked == 0


async def test_a_poll_of_a_future_that_stays_queued_answers_try_again_when_its_time_is_up_not_twice_that(
        served: Served) -> None:
    rid = served.queued_future()
    began = time.monotonic()
    r = await served.http.post("/retrieve_future", json={"request_id": rid})
    took = time.monotonic() - began
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "try_again" and r.json()["request_id"] == rid
    assert LONG_POLL_SECONDS * 0.9 < took < LONG_POLL_SECONDS * 1.6
    assert served.parked == 0


async def test_a_poll_woken_by_a_done_message_that_carries_the_result_answers_it_without_reading_back(
        served: Served) -> None:
    rid = served.queued_future()
    polls = [asyncio.create_task(served.http.post("/retrieve_future", json={"request_id": rid})) for _ in range(2)]
    await served.until_parked(2)
    # The record still says queued and no result is stored: only the message can have given the answer.
    served.redis.publish(served.keys.done_channel(rid), b"completed\n" + blobs.dumps({"path": "tinker://r/w/1"}))
    answers = await asyncio.gather(*polls)
    expected = {"path": "tinker://r/w/1", "type": "save_weights"}
    assert [(r.status_code, r.json()) for r in answers] == [(200, expected)] * 2


async def test_many_polls_of_one_future_all_wake(served: Served) -> None:
    rid = served.queued_future()
    polls = [asyncio.create_task(served.http.post("/retrieve_future", json={"request_id": rid})) for _ in range(20)]
    await served.until_parked(20)
    served.complete(rid)
    assert [r.status_code for r in await asyncio.gather(*polls)] == [200] * 20


async def test_polls_the_middleware_cannot_read_are_answered_at_once_by_the_route(served: Served) -> None:
    mine, theirs = served.queued_future(), served.queued_future(owner_key="tml-someone-else")
    no_key = {"X-API-Key": ""}
    as_json, as_text = {"content-type": "application/json"}, {"content-type": "text/plain"}
    cases = [
        ("no key", {"json": {"request_id": mine}, "headers": no_key}, 401),
        ("not JSON", {"content": b"{not json", "headers": as_json}, 400),
        ("no request id", {"json": {"id": mine}}, 400),
        ("request id too long", {"json": {"request_id": "x" * 201}}, 400),
        ("not a JSON content type", {"content": f'{{"request_id": "{mine}"}}', "headers": as_text}, 400),
        ("another caller's future", {"json": {"request_id": theirs}}, 404),
        ("no such future", {"json": {"request_id": new_request_id()}}, 404),
    ]
    for what, request, status in cases:
        began = time.monotonic()
        r = await served.http.post("/retrieve_future", **request)
        assert r.status_code == status, (what, r.text)
        assert r.json()["request_id"] == r.headers["x-request-id"], what
        assert time.monotonic() - began < LONG_POLL_SECONDS / 2, what
    assert served.parked == 0


async def test_a_parked_poll_of_a_future_that_fails_is_answered_byte_for_byte_as_the_route_answers_it(
        served: Served) -> None:
    rid = served.queued_future()
    parked = asyncio.create_task(served.http.post("/retrieve_future", json={"request_id": rid}))
    await served.until_parked(1)
    served.redis.hset(served.keys.future(rid), mapping={"status": "failed", "error": "Model m was unloaded — ü.",
                                                         "category": "user", "code": "adapter_gone"})
    served.redis.publish(served.keys.done_channel(rid), "failed")
    by_middleware = await parked
    # a +json media type the middleware leaves to the route, which reads the body as JSON all the same
    by_route = await served.http.post("/retrieve_future", content=f'{{"request_id": "{rid}"}}'.encode(),
                                      headers={"Content-Type": "application/merge-patch+json"})
    assert by_middleware.status_code == by_route.status_code == 200
    assert by_middleware.content == by_route.content
    assert by_middleware.json() == {"error": "Model m was unloaded — ü.", "category": "user", "code": "adapter_gone"}
    assert by_middleware.headers["content-type"] == by_route.headers["content-type"]
    assert by_middleware.headers.get("x-request-id") and served.parked == 0


RESULTS = {
    "forward_backward": (ForwardBackwardOutput([{"logprobs": np.array([-0.5, float("nan")], dtype=np.float32)}],
                                               {"loss:sum": 1.25}), "forward_backward"),
    "sample": (SampleOutput([SampledSequence([5, 6], [-0.1, -0.2], "length")], prompt_logprobs=[None, -1.5],
                            prompt_length=2), "sample"),
    "optim_step with a diverged metric": ({"metrics": {"grad_norm": float("inf"), "lr": 1e-4}}, "optim_step"),
    "save_state": ({"path": "tinker://run/weights/w1"}, "save_state"),
}


@pytest.mark.parametrize("carried", [False, True], ids=["read-back", "result-in-done-message"])
@pytest.mark.parametrize("accept", ["application/x-protobuf", "application/json"])
@pytest.mark.parametrize("kind", sorted(RESULTS))
async def test_a_parked_poll_of_a_future_that_completes_is_answered_byte_for_byte_as_the_route_answers_it(
        served: Served, kind: str, accept: str, carried: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    result, op = RESULTS[kind]
    answered_here: list[str] = []
    monkeypatch.setattr(long_poll, "result_answer", lambda record, *a, **kw: (
        answered_here.append(record.request_id), result_answer(record, *a, **kw))[1])
    rid = served.queued_future()
    served.redis.hset(served.keys.future(rid), "op", op)
    parked = asyncio.create_task(served.http.post("/retrieve_future", json={"request_id": rid},
                                                  headers={"Accept": accept}))
    await served.until_parked(1)
    served.redis.set(served.keys.blob_out(rid), blobs.dumps(result))
    served.redis.hset(served.keys.future(rid), "status", "completed")
    served.redis.publish(served.keys.done_channel(rid), b"completed\n" + blobs.dumps(result) if carried
                         else b"completed")
    by_middleware = await parked
    assert answered_here == [rid]  # by the middleware itself, not passed on to the route
    by_route = await served.http.post("/retrieve_future", content=f'{{"request_id": "{rid}"}}'.encode(),
                                      headers={"Content-Type": "application/merge-patch+json", "Accept": accept})
    assert by_middleware.status_code == by_route.status_code == 200
    assert by_middleware.content == by_route.content
    assert by_middleware.headers["content-type"] == by_route.headers["content-type"]
    assert by_middleware.headers["content-length"] == by_route.headers["content-length"]
    if isinstance(result, dict):  # what the route answered before it shared its rendering with the middleware
        assert by_middleware.content == FiniteJSONResponse(
            jsonable_encoder({**result, "type": {"save_state": "save_weights"}.get(op, op)})).body
    protobuf = accept == "application/x-protobuf" and kind in ("forward_backward", "sample")
    assert by_middleware.headers["content-type"] == ("application/x-protobuf" if protobuf else "application/json")


def record_reads(ctx: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids whose record the API reads from now on."""
    reads: list[str] = []
    read = ctx.store.future

    async def counted(request_id: str, owner: str) -> FutureRecord:
        reads.append(request_id)
        return await read(request_id, owner)

    monkeypatch.setattr(ctx.store, "future", counted)
    return reads


async def test_a_poll_of_a_future_this_process_submitted_waits_without_reading_it_and_answers_the_carried_result(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = served.app.state.ctx
    rid = await ctx.store.submit(op="save_state", owner=tenant_id(KEY), model_id="", queue="model.nobody.0",
                                 payload={})
    reads = record_reads(ctx, monkeypatch)
    poll = asyncio.create_task(served.http.post("/retrieve_future", json={"request_id": rid}))
    await served.until_parked(1)
    served.redis.publish(served.keys.done_channel(rid), b"completed\n" + blobs.dumps({"path": "tinker://r/w/2"}))
    answer = await poll
    assert (answer.status_code, answer.json()) == (200, {"path": "tinker://r/w/2", "type": "save_weights"})
    assert reads == []


async def test_a_future_submitted_before_the_subscription_dropped_is_read_when_polled(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = served.app.state.ctx
    rid = await ctx.store.submit(op="save_state", owner=tenant_id(KEY), model_id="", queue="model.nobody.0",
                                 payload={})
    ctx.hub.submitted.unsubscribed()  # what a lost connection does; its confirmed return starts a new epoch
    ctx.hub.submitted.subscribed()
    reads = record_reads(ctx, monkeypatch)
    # It ended while nobody listened: its done message never arrived, and only a read finds the outcome.
    served.redis.set(served.keys.blob_out(rid), blobs.dumps({"path": "tinker://r/w/3"}))
    served.redis.hset(served.keys.future(rid), "status", "completed")
    began = time.monotonic()
    answer = await served.http.post("/retrieve_future", json={"request_id": rid})
    assert (answer.status_code, answer.json()) == (200, {"path": "tinker://r/w/3", "type": "save_weights"})
    assert reads == [rid] and time.monotonic() - began < LONG_POLL_SECONDS / 2  # read at once, never parked
