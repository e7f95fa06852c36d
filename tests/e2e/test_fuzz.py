"""Fuzzing the HTTP surface: schemathesis generates requests for every operation of the launched server's
OpenAPI document; none may get a 5xx or hang, and the server keeps serving. Then the classic bad inputs,
each of which must be a 4xx with a message that says what is wrong."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.e2e.test_foundation import datum, fb_body, new_model
from tests.harness import LaunchedServer, launch

pytestmark = pytest.mark.e2e

KEY = "tml-fuzz"
EXAMPLES_PER_OPERATION = 25
REQUEST_TIMEOUT = 15.0  # a request that takes longer than this is a hang
# Ops that would take the live ids away from the rest of the run.
DESTRUCTIVE = {"/api/v1/unload_model", "/api/v1/sessions/{session_id}/finish"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server = launch(tmp_path_factory.mktemp("fuzz"), tiny_model_dir, db=6, sampler=True,
                    env={"TWINKLE_LONG_POLL_SECONDS": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def live_ids(server: LaunchedServer) -> dict[str, str]:
    """Real ids of the fuzzing key, swapped into generated bodies so that fuzzing reaches past the
    ownership checks into decoding and validation."""
    with server.client(KEY) as c:
        model = new_model(c)
        sid = c.post("/create_session", json={}).json()["session_id"]
        return {"model_id": model, "session_id": sid}


def with_live_ids(case: Any, ids: dict[str, str]) -> None:
    """Swap a real id in for about half the generated ones (those of even length: deterministic)."""
    if case.path in DESTRUCTIVE:
        return
    aliases = {"model_id": "model_id", "run_id": "model_id", "session_id": "session_id"}
    for container in (case.body, case.path_parameters):
        if not isinstance(container, dict):
            continue
        for key, id_kind in aliases.items():
            if isinstance(container.get(key), str) and len(container[key]) % 2 == 0:
                container[key] = ids[id_kind]


def bounded(node: Any) -> Any:
    """The API's own schema with small arrays and objects: generation stays fast and requests small,
    while every field, type and nesting level is still exercised."""
    if isinstance(node, dict):
        if node.get("type") == "array":
            node.setdefault("maxItems", 4)
        if node.get("type") == "object":
            node.setdefault("maxProperties", 4)
        for value in node.values():
            bounded(value)
    elif isinstance(node, list):
        for value in node:
            bounded(value)
    return node


def test_no_generated_request_gets_a_5xx_or_hangs(server: LaunchedServer, live_ids: dict[str, str]) -> None:
    schema = schemathesis.openapi.from_dict(bounded(httpx.get(server.base_url + "/openapi.json").json()))
    session = requests.Session()
    session.headers["X-API-Key"] = KEY
    problems: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) > 20
    started = time.monotonic()
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def probe(case: Any) -> None:
            with_live_ids(case, live_ids)
            sent = time.monotonic()
            try:
                response = case.call(base_url=server.base_url, session=session, timeout=REQUEST_TIMEOUT)
            except requests.Timeout:
                problems.append(f"{case.method} {case.formatted_path}: no answer in {REQUEST_TIMEOUT} s")
                return
            if response.status_code >= 500:
                problems.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                f"{response.text[:300]} (body {str(case.body)[:300]})")
            elif "Traceback" in response.text:
                problems.append(f"{case.method} {case.formatted_path} leaked a traceback")
            assert time.monotonic() - sent < REQUEST_TIMEOUT

        probe()
    assert problems == [], "\n".join(problems[:20])
    assert httpx.get(server.api + "/healthz").status_code == 200
    with server.client(KEY) as c:  # and still does real work
        rid = c.post("/forward_backward", json=fb_body(live_ids["model_id"], [datum([1, 2, 3])])).json()
        assert "request_id" in rid, rid
    assert time.monotonic() - started < 120


def proto_request(model_id: str, weights: bytes, dtype: int = 1) -> bytes:
    """A hand-built tinker_public.ForwardBackwardRequest with one datum (tokens 1,2,3)."""
    from api.tinker_codec import wire_schema as pb

    msg = pb.ForwardBackwardRequest()
    msg.model_id = model_id
    msg.loss_fn = "cross_entropy"
    item = msg.data.add()
    chunk = item.model_input.add()
    chunk.encoded_text.tokens = struct.pack("<3i", 1, 2, 3)
    item.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    item.loss_fn_inputs["target_tokens"].dense = struct.pack("<3q", 2, 3, 4)
    item.loss_fn_inputs["weights"].dtype = dtype
    item.loss_fn_inputs["weights"].dense = weights
    return bytes(msg.SerializeToString())


def tensor_case(key: str, value: Any) -> dict[str, Any]:
    d = datum([1, 2, 3, 4])
    d["loss_fn_inputs"][key] = value
    return d


BAD_BATCHES: list[tuple[str, Any, str]] = [
    ("a string dtype", tensor_case("weights", {"data": [1.0, 1.0, 1.0], "dtype": "complex128"}), "dtype"),
    ("float token ids", tensor_case("target_tokens", {"data": [1.5, 2.0, 3.0], "dtype": "int64"}), "whole number"),
    ("strings as numbers", tensor_case("weights", {"data": ["a", "b", "c"], "dtype": "float32"}), "numbers"),
    ("a shape that does not fit", tensor_case("weights", {"data": [1.0, 1.0, 1.0], "dtype": "float32",
                                                          "shape": [2, 2]}), "shape"),
    ("a negative dimension", tensor_case("weights", {"data": [1.0], "dtype": "float32", "shape": [-1]}),
     "negative"),
    ("weights one short", tensor_case("weights", {"data": [1.0, 1.0], "dtype": "float32"}), "tokens long"),
    ("ragged nested lists", tensor_case("weights", [[1.0], [1.0, 2.0]]), "rectangular"),
    ("negative token ids", tensor_case("target_tokens", {"data": [-1, 2, 3], "dtype": "int64"}), "token"),
]


@pytest.mark.parametrize(("what", "bad_datum", "fragment"), BAD_BATCHES, ids=[c[0] for c in BAD_BATCHES])
def test_wrong_dtypes_and_shapes_get_a_400_naming_the_problem(server: LaunchedServer, live_ids: dict[str, str],
                                                               what: str, bad_datum: Any, fragment: str) -> None:
    with server.client(KEY) as c:
        r = c.post("/forward_backward", json=fb_body(live_ids["model_id"], [bad_datum]))
        assert r.status_code == 400, (what, r.text)
        assert fragment in r.json()["error"], (what, r.json()["error"])


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_nan_and_infinity_in_float_tensors_get_a_400(server: LaunchedServer, live_ids: dict[str, str],
                                                      value: str) -> None:
    body = json.dumps(fb_body(live_ids["model_id"], [datum([1, 2, 3, 4])])).replace(
        '"data": [1.0, 1.0, 1.0]', f'"data": [1.0, {value}, 1.0]')
    assert value in body
    with server.client(KEY) as c:
        r = c.post("/forward_backward", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "NaN or infinite" in r.json()["error"]
        weights = struct.pack("<3f", 1.0, float(value.replace("Infinity", "inf")), 1.0)
        r = c.post("/forward_backward", content=proto_request(live_ids["model_id"], weights),
                   headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 400, r.text
        assert "NaN or infinite" in r.json()["error"]


@pytest.mark.parametrize(("body", "fragment"), [
    (b"\xff\xff\xff\xff", "not a valid tinker_public.ForwardBackwardRequest"),
    (b"\x0a\x05abc", "not a valid"),
    (b"", "model_id is required"),
])
def test_malformed_protobuf_gets_a_400(server: LaunchedServer, body: bytes, fragment: str) -> None:
    with server.client(KEY) as c:
        r = c.post("/forward_backward", content=body, headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]


def test_a_protobuf_tensor_with_a_torn_value_gets_a_400(server: LaunchedServer, live_ids: dict[str, str]) -> None:
    with server.client(KEY) as c:
        r = c.post("/forward_backward", content=proto_request(live_ids["model_id"], b"\x00" * 11),
                   headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 400 and "whole number" in r.json()["error"], r.text


@pytest.mark.parametrize(("change", "fragment"), [
    ({"num_samples": 10**9}, "num_samples"),
    ({"num_samples": 0}, "num_samples"),
    ({"sampling_params": {"max_tokens": -1}}, "max_tokens"),
    ({"sampling_params": {"max_tokens": 10**12}}, "max_tokens"),
    ({"sampling_params": {"temperature": -1}}, "temperature"),
    ({"prompt": {"chunks": []}}, "prompt"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [10**12]}]}}, "token"),
])
def test_bad_sampling_requests_get_a_400_naming_the_field(server: LaunchedServer, change: dict[str, Any],
                                                          fragment: str) -> None:
    body = {"base_model": "tiny-qwen", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4}, **change}
    with server.client(KEY) as c:
        r = c.post("/asample", json=body)
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"], r.json()["error"]
