"""The training submits are answered before the framework, with the bytes and headers the route answers, errors
included; a request the middleware cannot read as the route would accept it goes to the app untouched."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from api import submits
from tests.api.test_tinker_codec import ce_datum, sdk_forward_backward_body
from tests.harness import ApiInProcess, api_in_process
from twinkle.auth import tenant_id
from twinkle.futures import FutureRecord
from twinkle.records import ModelRecord

KEY = "tml-submits"


@dataclass
class Served(ApiInProcess):
    answered_here: list[bytes]

    def model(self, owner_key: str = KEY, status: str = "active", model_id: str = "") -> str:
        model_id = model_id or f"s{uuid.uuid4().hex[:8]}:train:0"
        base = next(iter(self.app.state.ctx.catalog.models))
        queue = self.app.state.ctx.catalog.models[base].model_queues[0]
        record = ModelRecord(model_id, tenant_id(owner_key), "s", base, "m", queue, status=status)
        self.redis.hset(self.keys.model(model_id), mapping=record.to_hash())
        return model_id

    def future(self, request_id: str) -> FutureRecord:
        return FutureRecord.from_hash(self.redis.hgetall(self.keys.future(request_id)))


@pytest.fixture
async def served(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Served]:
    """The API on its own (no pool worker: submitted ops stay queued); `request.param`: the pool's extra args."""
    answered_here: list[bytes] = []
    render = submits.finite_json_bytes
    monkeypatch.setattr(submits, "finite_json_bytes", lambda body: answered_here.append(b := render(body)) or b)
    async with api_in_process(KEY, long_poll_seconds=1, pool_args=getattr(request, "param", {})) as api:
        yield Served(api.http, api.app, api.redis, api.keys, answered_here)


def fb_body(model_id: str, loss_fn: str = "cross_entropy") -> dict[str, Any]:
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [6, 7, 8], "dtype": "int64"},
                                "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"}}}
    return {"model_id": model_id, "forward_backward_input": {"data": [datum], "loss_fn": loss_fn}}


def optim_body(model_id: str, **extra: Any) -> dict[str, Any]:
    return {"model_id": model_id, "adam_params": {"learning_rate": 1e-4}, **extra}


def sample_body(served: Served, **extra: Any) -> dict[str, Any]:
    return {"base_model": next(iter(served.app.state.ctx.catalog.models)), "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 4, "temperature": 1.0}, **extra}


async def by_route(served: Served, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any],
                   **kwargs: Any) -> httpx.Response:
    """The same request, handed on to the app by the middleware (as one it cannot read would be)."""
    with monkeypatch.context() as patched:
        patched.setattr(submits.Submits, "_submit_of", lambda *_: None)
        return await served.http.post(path, json=body, **kwargs)


def same_headers(response: httpx.Response) -> list[tuple[str, str]]:
    """The answer's headers, in order, but its date and its request id (each answer has its own)."""
    assert response.headers.get("x-request-id")
    return [(name, value) for name, value in response.headers.items() if name not in ("date", "x-request-id")]


def without_ids(response: httpx.Response) -> dict[str, Any]:
    body = dict(response.json())
    body.pop("request_id", None)  # each submit is a future of its own, each answer an x-request-id of its own
    return body


@pytest.mark.parametrize(("path", "body"), [("/forward_backward", fb_body), ("/forward", fb_body),
                                            ("/optim_step", optim_body)])
async def test_a_submit_is_answered_by_the_middleware_as_the_route_answers_it(
        served: Served, monkeypatch: pytest.MonkeyPatch, path: str, body: Any) -> None:
    model_id = served.model()
    mine = await served.http.post(path, json=body(model_id))
    assert served.answered_here == [mine.content]  # by the middleware, not passed on to the route
    theirs = await by_route(served, monkeypatch, path, body(model_id))
    assert served.answered_here == [mine.content]
    assert mine.status_code == theirs.status_code == 200
    assert mine.content == theirs.content.replace(theirs.json()["request_id"].encode(),
                                                  mine.json()["request_id"].encode())
    assert same_headers(mine) == same_headers(theirs)
    assert mine.json() == {"request_id": mine.json()["request_id"], "model_id": model_id}
    submitted = [served.future(response.json()["request_id"]) for response in (mine, theirs)]
    assert {(f.op, f.owner, f.model_id, f.queue, f.status) for f in submitted} == {
        (submitted[0].op, tenant_id(KEY), model_id, submitted[0].queue, submitted[0].status)}
    assert submitted[0].op == path.strip("/")


async def test_a_sample_is_answered_by_the_middleware_as_the_route_answers_it(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = await served.http.post("/asample", json=sample_body(served))
    assert served.answered_here == [mine.content]
    theirs = await by_route(served, monkeypatch, "/asample", sample_body(served))
    assert served.answered_here == [mine.content]
    assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
    ids = {response: response.json()["request_id"] for response in (mine, theirs)}
    assert mine.content == theirs.content.replace(ids[theirs].encode(), ids[mine].encode())
    assert same_headers(mine) == same_headers(theirs)
    assert mine.json()["sample_sequence_ids"] == [f"{ids[mine]}:0", f"{ids[mine]}:1"]
    assert {(f.op, f.owner, f.status) for f in map(served.future, ids.values())} == {
        ("sample", tenant_id(KEY), served.future(ids[mine]).status)}


@pytest.mark.parametrize(("what", "extra", "status"), [
    ("a sampling session that does not exist", {"sampling_session_id": "s0:sample:0", "base_model": None}, 404),
    ("a checkpoint that does not exist", {"model_path": "tinker://s0:train:0/sampler_weights/none",
                                          "base_model": None}, 404),
    ("prompt_logprobs_last_n without prompt logprobs", {"prompt_logprobs_last_n": 1}, 400),
])
async def test_a_sample_the_service_refuses_is_answered_as_the_route_answers_it(
        served: Served, monkeypatch: pytest.MonkeyPatch, what: str, extra: dict[str, Any], status: int) -> None:
    mine = await served.http.post("/asample", json=sample_body(served, **extra))
    theirs = await by_route(served, monkeypatch, "/asample", sample_body(served, **extra))
    assert mine.status_code == theirs.status_code == status, (what, mine.text, theirs.text)
    assert without_ids(mine) == without_ids(theirs) and same_headers(mine) == same_headers(theirs)
    assert served.answered_here == []


@pytest.mark.parametrize("compress", [False, True], ids=["protobuf", "protobuf with zstd"])
async def test_the_sdks_protobuf_forward_backward_is_answered_by_the_middleware_as_the_route_answers_it(
        served: Served, monkeypatch: pytest.MonkeyPatch, compress: bool) -> None:
    model_id = served.model(model_id="s1:train:0")  # the model the SDK's recorded request names
    body, headers = await asyncio.to_thread(sdk_forward_backward_body, [ce_datum([5, 6, 7, 8])], compress=compress)
    mine = await served.http.post("/forward_backward", content=body, headers=headers)
    assert served.answered_here == [mine.content], mine.text
    with monkeypatch.context() as patched:
        patched.setattr(submits.Submits, "_submit_of", lambda *_: None)
        theirs = await served.http.post("/forward_backward", content=body, headers=headers)
    assert mine.status_code == theirs.status_code == 200
    assert without_ids(mine) == without_ids(theirs) == {"model_id": model_id}
    assert same_headers(mine) == same_headers(theirs)
    assert served.future(mine.json()["request_id"]).op == "forward_backward"


ERRORS = {
    "a model that does not exist": (lambda s: "s0:train:0", 404),
    "another caller's model": (lambda s: s.model(owner_key="tml-someone-else"), 404),
    "a model that was unloaded": (lambda s: s.model(status="unloaded"), 410),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
@pytest.mark.parametrize("path", ["/forward_backward", "/optim_step"])
async def test_a_submit_that_fails_is_answered_as_the_route_answers_it(
        served: Served, monkeypatch: pytest.MonkeyPatch, case: str, path: str) -> None:
    make_model, status = ERRORS[case]
    model_id = make_model(served)
    body = fb_body(model_id) if path == "/forward_backward" else optim_body(model_id)
    mine = await served.http.post(path, json=body)
    theirs = await by_route(served, monkeypatch, path, body)
    assert mine.status_code == theirs.status_code, (mine.text, theirs.text)
    assert mine.status_code == status or mine.status_code // 100 == 4, mine.text
    assert without_ids(mine) == without_ids(theirs) and same_headers(mine) == same_headers(theirs)
    assert mine.json()["request_id"] == mine.headers["x-request-id"]
    assert mine.headers["x-should-retry"] == "false"
    assert served.answered_here == []  # errors go out through the app's own error answers


@pytest.mark.parametrize(("path", "body"), [
    ("/forward_backward", lambda m: fb_body(m, loss_fn="no_such_loss")),
    ("/optim_step", lambda m: {"model_id": m}),  # valid JSON, but no adam_params: the submit refuses it
])
async def test_a_submit_the_service_refuses_is_answered_as_the_route_answers_it(
        served: Served, monkeypatch: pytest.MonkeyPatch, path: str, body: Any) -> None:
    model_id = served.model()
    mine = await served.http.post(path, json=body(model_id))
    theirs = await by_route(served, monkeypatch, path, body(model_id))
    assert mine.status_code == theirs.status_code == 400, mine.text
    assert without_ids(mine) == without_ids(theirs) and same_headers(mine) == same_headers(theirs)


async def test_requests_the_middleware_cannot_read_are_answered_by_the_app_as_before(served: Served) -> None:
    model_id = served.model()
    cases = [
        ("/optim_step", "no key", {"json": optim_body(model_id), "headers": {"X-API-Key": ""}}, 401),
        ("/forward_backward", "no key", {"json": fb_body(model_id), "headers": {"X-API-Key": ""}}, 401),
        ("/optim_step", "not JSON", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400),
        ("/optim_step", "a field of the wrong type", {"json": optim_body(model_id, seq_id="first")}, 400),
        ("/optim_step", "no model id", {"json": {"adam_params": {"learning_rate": 1e-4}}}, 400),
        ("/asample", "no key", {"json": sample_body(served), "headers": {"X-API-Key": ""}}, 401),
        ("/asample", "no samples asked", {"json": sample_body(served, num_samples=0)}, 400),
        ("/asample", "an unsupported field set", {"json": sample_body(served, prompt_alt_tokens_k=2)}, 400),
    ]
    for path, what, request, status in cases:
        r = await served.http.post(path, **request)
        assert r.status_code == status, (path, what, r.text)
        assert r.json()["request_id"] == r.headers["x-request-id"], what
    assert served.answered_here == []


@pytest.mark.parametrize("served", [{"queue_config": {"rps_limit": 0.2, "window_seconds": 5}}], indirect=True)
async def test_a_rate_limited_submit_gets_the_apps_429_with_its_retry_after(served: Served) -> None:
    model_id = served.model()
    first = await served.http.post("/optim_step", json=optim_body(model_id))
    began = time.monotonic()
    refused = await served.http.post("/optim_step", json=optim_body(model_id))
    assert first.status_code == 200 and refused.status_code == 429, refused.text
    assert refused.json()["code"] == "rate_limited" and refused.json()["category"] == "user"
    assert int(refused.headers["Retry-After"]) >= 1 and int(refused.headers["Retry-After-Ms"]) >= 1
    assert refused.headers["x-should-retry"] == "true"
    assert time.monotonic() - began < 1.0  # within the key's free refusals: the tarpit holds nothing
    assert json.loads(refused.content)["request_id"] == refused.headers["x-request-id"]
