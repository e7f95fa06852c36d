"""Every answer is declared (api/responses/): /openapi.json names a schema for each route's success and errors,
and the real answers of a launched server (mock pools) validate against the models their routes declare,
strictly, as JSON on the wire, with no field a model does not name."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from api.app import create_app
from api.finite_json import FiniteJSONResponse
from api.responses.answer import described_by
from api.responses.errors import ErrorAnswer, OpenAIErrorAnswer
from api.responses.tinker import FutureHandle
from tests.e2e.test_foundation import datum, fb_body
from tests.harness import LaunchedServer, launch, mock_config
from twinkle.config.loader import parse_config

pytestmark = pytest.mark.e2e

API = "/api/v1"
JSON = "application/json"
KEY = "tml-contracts"
# Successes that are no JSON answer of ours, with the media type each declares instead.
NOT_JSON = {
    f"GET {API}/downloads/{{run_id}}/{{kind}}/{{name}}/files/{{file_path}}": "application/octet-stream",
    f"GET {API}/downloads/{{run_id}}/{{kind}}/{{name}}/merged/files/{{file_path}}": "application/octet-stream",
    f"GET {API}/tokenizer_files/{{name}}": "application/octet-stream",
    f"GET {API}/downloads/{{run_id}}/{{kind}}/{{name}}/archive.tar": "application/x-tar",
    f"GET {API}/downloads/{{run_id}}/{{kind}}/{{name}}/merged/archive.tar": "application/x-tar",
}
# Routes outside /openapi.json that answer HTML or static files: the console's pages and assets.
CONSOLE_PAGES = {"GET /console", "GET /console/", "GET /console/static/{name}", "GET /console/fragments/overview",
                 "GET /console/fragments/runs/{run_id}", "GET /console/fragments/usage"}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]}


def declared_model(route: RouteContext) -> Any:
    """The model a route declares for its success answer (None: it declares none)."""
    described = [m.model for m in getattr(route.response_model, "__metadata__", ()) if hasattr(m, "model")]
    if described:
        return described[0]
    for status in (200, 302):
        if "model" in route.responses.get(status, {}):
            return route.responses[status]["model"]
    return route.response_model  # a model FastAPI validates itself (the usage report), or None


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    tmp = tmp_path_factory.mktemp("openapi")
    return create_app(parse_config(mock_config(tmp, tmp / "ckpt", port=1, db=15)), "redis://127.0.0.1:1/0")


@pytest.fixture(scope="module")
def declared(app: FastAPI) -> dict[str, Any]:
    """`METHOD /path` of every route of the app (the console's too) -> the model it declares."""
    return {f"{method} {route.path_format}": declared_model(route) for route in iter_route_contexts(app.routes)
            if isinstance(route.original_route, APIRoute) for method in route.methods or ()}


def is_named(schema: dict[str, Any]) -> bool:
    """A reference to a named component, or a union of such references."""
    return "$ref" in schema or (bool(schema.get("anyOf")) and all("$ref" in s for s in schema["anyOf"]))


def test_openapi_names_a_success_and_an_error_schema_for_every_operation(app: FastAPI) -> None:
    problems = []
    for path, methods in app.openapi()["paths"].items():
        for method, operation in methods.items():
            name = f"{method.upper()} {path}"
            responses = operation["responses"]
            successes = [code for code in responses if code[0] in "23"]
            if len(successes) != 1:
                problems.append(f"{name}: successes {successes}")
                continue
            content = responses[successes[0]].get("content", {})
            if name in NOT_JSON:
                if list(content) != [NOT_JSON[name]]:
                    problems.append(f"{name}: answers {list(content)}, not only {NOT_JSON[name]}")
            elif not is_named(content.get(JSON, {}).get("schema", {})):
                problems.append(f"{name}: no named JSON schema for {successes[0]}: {content.get(JSON)}")
            error = "OpenAIErrorAnswer" if path.startswith("/v1/") else "ErrorAnswer"
            for status in ("4XX", "5XX"):
                if responses.get(status, {}).get("content", {}).get(JSON, {}).get("schema") != {
                        "$ref": f"#/components/schemas/{error}"}:
                    problems.append(f"{name}: {status} is not {error}")
            if "422" in responses:  # a body that fails validation is answered 400, in the error shape
                problems.append(f"{name}: declares FastAPI's 422")
    assert problems == []


def test_every_route_outside_the_schema_declares_its_answer_too_unless_it_serves_html(
        declared: dict[str, Any]) -> None:
    undeclared = {name for name, model in declared.items() if model is None}
    assert undeclared == CONSOLE_PAGES | set(NOT_JSON)


def test_the_alternatives_to_json_are_declared_as_their_media_types(app: FastAPI) -> None:
    paths = app.openapi()["paths"]
    assert "application/x-protobuf" in paths[f"{API}/retrieve_future"]["post"]["responses"]["200"]["content"]
    for completion in ("/v1/chat/completions", "/v1/completions"):
        assert "text/event-stream" in paths[completion]["post"]["responses"]["200"]["content"]
    assert "text/csv" in paths[f"{API}/usage"]["get"]["responses"]["200"]["content"]
    redirect = paths[f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id}}/archive"]["get"]["responses"]
    assert redirect["302"]["content"][JSON]["schema"] == {"$ref": "#/components/schemas/ArchiveLink"}


def test_a_described_route_answers_the_bytes_its_bare_dict_did() -> None:
    app = FastAPI(default_response_class=FiniteJSONResponse)
    answer = {"request_id": "r-1", "model_id": "s:train:0", "undeclared": [1.5, math.nan, "ü"], "nested": {"a": None}}

    @app.post("/bare")
    async def bare() -> dict[str, Any]:
        return answer

    @app.post("/described", response_model=described_by(FutureHandle))
    async def described() -> dict[str, Any]:
        return answer

    client = TestClient(app)
    assert client.post("/described").content == client.post("/bare").content


# -- contracts: a launched server's answers ------------------------------------------------------------------


class Contracts:
    """Calls a launched server as one key and checks each answer against the model its route declares."""

    def __init__(self, declared: dict[str, Any], server: LaunchedServer, client: httpx.Client) -> None:
        self.adapters = {name: TypeAdapter(model) for name, model in declared.items() if model is not None}
        self.base_url = server.base_url
        self.c = client

    def route(self, path: str) -> str:
        """Paths are the API's, under its prefix, but for the OpenAI routes' and the console's."""
        return path if path.startswith(("/v1/", "/console/")) else API + path

    def call(self, method: str, path: str, template: str | None = None, *, status: int = 200, **kwargs: Any) -> Any:
        """The answer's JSON, once it validated (strictly, as sent) against the model of `METHOD template`."""
        name = f"{method} {self.route(template or path)}"
        response = self.c.request(method, self.base_url + self.route(path), **kwargs)
        assert response.status_code == status, f"{name}: {response.status_code} {response.text}"
        self.adapters[name].validate_json(response.content, strict=True)
        return response.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.call("POST", path, json=body)

    def get(self, path: str, template: str | None = None) -> Any:
        return self.call("GET", path, template)

    def refused(self, method: str, path: str, status: int, model: type[ErrorAnswer | OpenAIErrorAnswer] = ErrorAnswer,
                **kwargs: Any) -> None:
        """An error answer, in the error model its routes declare."""
        response = self.c.request(method, self.base_url + self.route(path), **kwargs)
        assert response.status_code == status, response.text
        model.model_validate_json(response.content, strict=True)

    def result(self, request_id: str) -> Any:
        """The future's result; each poll's answer checked on the way."""
        while True:
            body = self.post("/retrieve_future", {"request_id": request_id})
            if body.get("type") != "try_again":
                return body

    def submit(self, path: str, body: dict[str, Any]) -> Any:
        """Submit an op and wait for its result: both answers checked."""
        return self.result(self.post(path, body)["request_id"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    """Mock model, sampler and processor pools; polls are held 1 s, so that a pending op answers try_again soon."""
    launched = launch(tmp_path_factory.mktemp("contracts"), tiny_model_dir, db=10, sampler=True, processor=True,
                      env={"TWINKLE_LONG_POLL_SECONDS": "1"})
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def contracts(server: LaunchedServer, declared: dict[str, Any]) -> Iterator[Contracts]:
    with server.client(KEY) as client:
        yield Contracts(declared, server, client)


@pytest.fixture(scope="module")
def trained(contracts: Contracts) -> dict[str, str]:
    """A session and a run of the key, with one optimizer step and a training and a sampler checkpoint."""
    k = contracts
    session = k.post("/create_session", {"tags": [], "sdk_version": "contracts"})["session_id"]
    created = k.post("/create_model", {"session_id": session, "base_model": "tiny-qwen", "lora_config": {"rank": 4}})
    model = k.result(created["request_id"])["model_id"]
    k.submit("/forward_backward", fb_body(model, [datum([3, 4, 5, 6, 7])]))
    k.submit("/optim_step", {"model_id": model, "adam_params": {"learning_rate": 0.01}})
    weights = k.submit("/save_weights", {"model_id": model, "path": "ckpt-1"})["path"]
    sampler = k.submit("/save_weights_for_sampler", {"model_id": model, "path": "samp-1"})["path"]
    return {"session": session, "model": model, "weights": weights, "sampler": sampler}


def test_bootstrap_and_session_answers_match_their_models(contracts: Contracts, trained: dict[str, str]) -> None:
    k, session = contracts, trained["session"]
    k.get("/healthz")
    k.post("/client/config", {})
    k.post("/client/dynamic_config", {})
    k.get("/get_server_capabilities")
    k.post("/session_heartbeat", {"session_id": session})
    assert session in k.get("/sessions")["sessions"]
    assert trained["model"] in k.get(f"/sessions/{session}", "/sessions/{session_id}")["training_run_ids"]
    k.post("/telemetry", {})
    k.refused("GET", "/sessions/no-such-session", 404)
    k.refused("POST", "/create_session", 400, json={"tags": "not a list"})


def test_training_submits_and_their_results_match_their_models(contracts: Contracts,
                                                               trained: dict[str, str]) -> None:
    k, model = contracts, trained["model"]
    assert k.post("/get_info", {"model_id": model})["model_id"] == model
    batch = {"data": [datum([3, 4, 5, 6])], "loss_fn": "cross_entropy"}
    assert "loss:sum" in k.submit("/forward", {"model_id": model, "forward_input": batch})["metrics"]
    unnamed = k.submit("/save_weights_for_sampler", {"model_id": model})
    assert unnamed["type"] == "save_weights_for_sampler" and unnamed["sampling_session_id"]
    assert k.submit("/load_weights", {"model_id": model, "path": trained["weights"]})["type"] == "load_weights"
    assert k.submit("/save_weights_external", {"model_id": model, "path": "ext-1"})["type"] == "save_weights_external"
    failed = k.submit("/load_weights", {"model_id": model, "path": trained["sampler"], "optimizer": True})
    assert failed["category"] == "user" and "optimizer" in failed["error"]
    k.refused("POST", "/export_merged", 400, json={"path": trained["weights"]})  # the mock backend cannot merge


def test_a_pending_op_answers_try_again_in_its_model(contracts: Contracts, server: LaunchedServer,
                                                     trained: dict[str, str]) -> None:
    k = contracts
    worker = server.worker_pid()
    os.kill(worker, signal.SIGSTOP)  # the op stays queued past the 1 s poll
    try:
        handle = k.post("/optim_step", {"model_id": trained["model"], "adam_params": {"learning_rate": 0.01}})
        pending = k.post("/retrieve_future", {"request_id": handle["request_id"]})
        assert pending["type"] == "try_again", pending
    finally:
        os.kill(worker, signal.SIGCONT)
    assert k.result(handle["request_id"])["type"] == "optim_step"


def test_sampling_answers_match_their_models(contracts: Contracts, trained: dict[str, str]) -> None:
    k = contracts
    created = k.post("/create_sampling_session", {"session_id": trained["session"], "model_path": trained["sampler"]})
    sampler = created["sampling_session_id"]
    assert k.get(f"/samplers/{sampler}", "/samplers/{sampler_id}")["model_path"] == trained["sampler"]
    submitted = k.post("/asample", {"sampling_session_id": sampler, "prompt": PROMPT, "num_samples": 2,
                                    "sampling_params": {"max_tokens": 3}, "prompt_logprobs": True,
                                    "topk_sample_logprobs": 2})
    sample = k.result(submitted["request_id"])
    assert sample["type"] == "sample" and len(sample["sequences"]) == 2 and sample["prompt_logprobs"][0] is None


def test_run_and_checkpoint_answers_match_their_models(contracts: Contracts, trained: dict[str, str]) -> None:
    k, run = contracts, trained["model"]
    checkpoint = f"/training_runs/{run}/checkpoints/weights/ckpt-1"
    template = "/training_runs/{run_id}/checkpoints/{checkpoint_id}"
    assert k.get("/training_runs")["cursor"]["total_count"] >= 1
    assert k.get(f"/training_runs/{run}", "/training_runs/{run_id}")["last_checkpoint"] is not None
    assert k.get(f"/training_runs/{run}/checkpoints", "/training_runs/{run_id}/checkpoints")["checkpoints"]
    assert k.get("/checkpoints")["cursor"]["total_count"] >= 2
    k.post("/weights_info", {"tinker_path": trained["weights"]})
    k.call("POST", f"{checkpoint}/publish", f"{template}/publish")
    k.call("DELETE", f"{checkpoint}/publish", f"{template}/publish")
    k.call("PUT", f"{checkpoint}/ttl", f"{template}/ttl", json={"ttl_seconds": 3600})
    assert k.get(f"{checkpoint}/external_weights_urls", f"{template}/external_weights_urls")["urls"]
    k.call("GET", f"{checkpoint}/archive", f"{template}/archive", status=302)
    copied = k.post("/copy_weights", {"source_path": trained["weights"], "destination_project_id": "contracts"})
    assert copied["tinker_path"].endswith("/weights/ckpt-1")
    assert k.get("/tokenizer_files?model=tiny-qwen", "/tokenizer_files")["files"]
    k.call("DELETE", f"/training_runs/{run}/checkpoints/sampler_weights/samp-1", template)
    k.refused("GET", f"/training_runs/{run}/checkpoints/weights/no-such/external_weights_urls", 404)


def test_twinkle_client_answers_and_results_match_their_models(contracts: Contracts, trained: dict[str, str]) -> None:
    k = contracts
    created = k.post("/create_model", {"session_id": trained["session"], "base_model": "tiny-qwen"})
    model = k.result(created["request_id"])["model_id"]
    inputs = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}]
    assert k.submit("/twinkle/configure", {"model_id": model, "gradient_accumulation_steps": 1})["train_config"]
    assert k.submit("/twinkle/forward_backward", {"model_id": model, "inputs": inputs})["type"] == "forward_backward"
    assert k.submit("/twinkle/forward_only", {"model_id": model, "inputs": inputs})["type"] == "forward"
    assert k.submit("/twinkle/clip_grad_and_step", {"model_id": model})["stepped"] is True
    assert k.submit("/twinkle/calculate_metric", {"model_id": model})["result"]["cur_step"] == 1
    assert k.submit("/twinkle/get_train_configs", {"model_id": model})["cur_step"] == 1
    saved = k.submit("/twinkle/save", {"model_id": model, "name": "twinkle-1"})["path"]
    resumed = k.submit("/twinkle/resume_from_checkpoint", {"model_id": model, "path": saved})
    assert resumed["progress"]["cur_step"] == 1
    assert k.get("/twinkle/capacity_info")["models"]
    rows = [{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}]
    encoded = k.submit("/twinkle/encode", {"template": "Qwen3_5Template", "rows": rows,
                                           "template_kwargs": {"model_id": "tiny-qwen"}})
    assert len(encoded["features"]) == 1
    assert k.submit("/unload_model", {"model_id": model})["type"] == "unload_model"


def test_openai_answers_match_their_models(contracts: Contracts) -> None:
    k = contracts
    assert "tiny-qwen" in {m["id"] for m in k.get("/v1/models")["data"]}
    chat = k.post("/v1/chat/completions", {"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
    assert chat["choices"][0]["logprobs"]["content"]
    completion = k.post("/v1/completions", {"model": "tiny-qwen", "prompt": "hello", "max_tokens": 2, "echo": True,
                                            "logprobs": 1})
    assert completion["choices"][0]["logprobs"]["tokens"]
    k.refused("POST", "/v1/chat/completions", 404, OpenAIErrorAnswer,
              json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})


def test_the_consoles_json_matches_its_model(contracts: Contracts, trained: dict[str, str]) -> None:
    metrics = contracts.get(f"/console/api/runs/{quote(trained['model'], safe='')}/metrics",
                            "/console/api/runs/{run_id}/metrics")
    assert metrics["run_id"] == trained["model"] and metrics["steps"] >= 1


def test_finishing_the_session_answers_its_model(contracts: Contracts, trained: dict[str, str]) -> None:
    contracts.call("POST", f"/sessions/{trained['session']}/finish", "/sessions/{session_id}/finish", json={})
