"""Bounded input over real HTTP: bodies refused while they stream in (the API's memory does not grow), JSON
nested too deep refused before parsing, ids and checkpoint names that could not be addressed later refused
at creation, metadata symlinks not followed, absurd hyper-parameters refused and non-finite results
delivered instead of a 500, token ids checked on the Twinkle routes on every backend."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard

from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.harness import LaunchedServer, launch
from twinkle.auth import tenant_id

pytestmark = pytest.mark.e2e

KEY = "tml-bounded"
MB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server = launch(tmp_path_factory.mktemp("bounded"), tiny_model_dir, db=13, processor=True,
                    env={"TWINKLE_LONG_POLL_SECONDS": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(server: LaunchedServer) -> str:
    with server.client(KEY) as c:
        return new_model(c)


def megabytes(n: int) -> Iterator[bytes]:
    chunk = b"[" + b"0," * (MB // 2 - 1) + b"0"  # looks like the start of a JSON list, never ends
    for _ in range(n):
        yield chunk


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_300_mb_body_is_refused_with_413_without_the_api_growing(server: LaunchedServer, declared: bool) -> None:
    api = server.api_process()
    before = api.memory_info().rss
    headers = {"X-API-Key": KEY, "content-type": "application/json"}
    if declared:
        headers["content-length"] = str(300 * MB)
    r = httpx.post(server.api + "/create_session", content=megabytes(300), headers=headers, timeout=60)
    assert r.status_code == 413, r.text
    assert r.json()["code"] == "payload_too_large" and "at most 1048576 bytes" in r.json()["error"]
    grown = (api.memory_info().rss - before) / MB
    assert grown < 16, f"the API grew by {grown:.0f} MB refusing the body"
    assert httpx.get(server.api + "/healthz").status_code == 200


def test_compute_routes_take_large_bodies_and_refuse_larger_ones(server: LaunchedServer, model: str) -> None:
    with server.client(KEY) as c:
        big = fb_body(model, [datum([(i % 90) + 2 for i in range(1500)])] * 400)  # about 2.4 MB of JSON
        r = c.post("/forward_backward", json=big)
        assert r.status_code == 200, r.text
        assert "error" not in wait(c, r.json()["request_id"])
        session = c.post("/create_session", json={"user_metadata": {"blob": "x" * (2 * MB)}})
        assert session.status_code == 413, session.text
        over = c.post("/forward_backward", content=megabytes(65), headers={"content-type": "application/x-protobuf"})
        assert over.status_code == 413 and "67108864" in over.json()["error"], over.text


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(("path", "body"), [
    ("/create_session", lambda model: f'{{"user_metadata": {{"a": {deep(10_000)}}}}}'),
    ("/forward_backward", lambda model: json.dumps(fb_body(model, [datum([1, 2, 3])])).replace(
        '"cross_entropy"', f'"cross_entropy", "loss_fn_config": {{"x": {deep(10_000)}}}')),
    ("/twinkle/forward_backward",
     lambda model: f'{{"model_id": "{model}", "inputs": [{{"messages": {deep(10_000)}}}]}}'),
    ("/create_session", lambda model: f'{{"user_metadata": {{"a": {deep(65)}}}}}'),
], ids=["session", "tinker-fb", "twinkle-fb", "just-over-the-limit"])
def test_json_nested_too_deep_gets_a_400_before_parsing(server: LaunchedServer, model: str, path: str,
                                                       body: Any) -> None:
    with server.client(KEY) as c:
        r = c.post(path, content=body(model), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nests deeper than 64 levels" in r.json()["error"]
        ok = c.post("/create_session", json={"user_metadata": {"a": json.loads(deep(60))}})
        assert ok.status_code == 200, ok.text


def test_a_deep_zstd_body_is_checked_after_decompression(server: LaunchedServer, model: str) -> None:
    body = json.dumps(fb_body(model, [datum([1, 2, 3])])).replace(
        '"cross_entropy"', f'"cross_entropy", "loss_fn_config": {{"x": {deep(10_000)}}}')
    with server.client(KEY) as c:
        r = c.post("/forward_backward", content=zstandard.ZstdCompressor().compress(body.encode()),
                   headers={"content-type": "application/json", "content-encoding": "zstd"})
        assert r.status_code == 400 and "nests deeper" in r.json()["error"], r.text


@pytest.mark.parametrize("name", ["ckpt\n", "ckpt\r", "ck\tpt", "ckpt\x00", "ckpt\x1b[31m"])
def test_checkpoint_names_with_newlines_or_control_characters_are_refused(server: LaunchedServer, model: str,
                                                                          name: str) -> None:
    with server.client(KEY) as c:
        for path, body in (("/save_weights", {"model_id": model, "path": name}),
                           ("/save_weights_for_sampler", {"model_id": model, "path": name}),
                           ("/twinkle/save", {"model_id": model, "name": name})):
            r = c.post(path, json=body)
            assert r.status_code == 400 and "Invalid checkpoint name" in r.json()["error"], (path, r.text)


def test_sequence_numbers_that_would_make_unaddressable_ids_are_refused(server: LaunchedServer, model: str) -> None:
    with server.client(KEY) as c:
        sid = c.post("/create_session", json={}).json()["session_id"]
        huge = 10**400  # a 425-character model id, longer than any route accepts back
        for path, body in (
                ("/create_model", {"session_id": sid, "base_model": "tiny-qwen", "model_seq_id": huge}),
                ("/create_sampling_session", {"session_id": sid, "base_model": "tiny-qwen",
                                              "sampling_session_seq_id": huge}),
                ("/save_weights_for_sampler", {"model_id": model, "sampling_session_seq_id": huge}),
                ("/optim_step", {"model_id": model, "seq_id": huge, "adam_params": {}})):
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
        largest = c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen",
                                                "model_seq_id": 2**63 - 1, "lora_config": {"rank": 4}})
        assert largest.status_code == 200, largest.text
        model_id = largest.json()["model_id"]
        assert "error" not in wait(c, largest.json()["request_id"])
        assert c.post("/unload_model", json={"model_id": model_id}).status_code == 200  # addressable


def test_a_symlinked_metadata_file_is_not_followed(server: LaunchedServer, model: str, tmp_path: Path) -> None:
    with server.client(KEY) as c:
        saved = wait(c, c.post("/save_weights", json={"model_id": model, "path": "linked"}).json()["request_id"])
        path = saved["path"]
        assert c.post("/weights_info", json={"tinker_path": path}).status_code == 200
        checkpoint = Path(server.config["storage"]["checkpoint_dir"]) / tenant_id(KEY) / model / "weights" / "linked"
        secret = tmp_path / "elsewhere.json"
        secret.write_text(json.dumps({"base_model": "someone-elses-secret", "lora": {"rank": 99}}))
        metadata = checkpoint / "checkpoint_metadata.json"
        metadata.unlink()
        metadata.symlink_to(secret)
        r = c.post("/weights_info", json={"tinker_path": path})
        assert r.status_code == 404 and "someone-elses-secret" not in r.text, r.text
        loaded = c.post("/load_weights", json={"model_id": model, "path": path})
        assert loaded.status_code == 404, loaded.text


def test_an_absurd_learning_rate_is_refused_on_both_route_families(server: LaunchedServer, model: str) -> None:
    with server.client(KEY) as c:
        r = c.post("/optim_step", json={"model_id": model, "adam_params": {"learning_rate": 1e308}})
        assert r.status_code == 400 and "learning_rate is 1e+308, over the limit" in r.json()["error"], r.text
        configured = c.post("/twinkle/configure", json={"model_id": model, "optimizer": "AdamW",
                                                         "optimizer_kwargs": {"lr": 1e308}})
        assert configured.status_code == 200, configured.text
        failed = wait(c, configured.json()["request_id"])
        assert failed["category"] == "user" and "over the limit" in failed["error"], failed
        assert c.post("/optim_step", json={"model_id": model, "adam_params": {"learning_rate": 1.0}}).status_code == 200


def diverging_datum() -> dict[str, Any]:
    """Importance sampling against sampler logprobs of -1e30: the ratio overflows to infinity."""
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
                               "logprobs": {"data": [-1e30] * 3, "dtype": "float32"},
                               "advantages": {"data": [1.0, -1.0, 1.0], "dtype": "float32"}}}


def test_a_result_holding_nan_or_infinity_is_delivered_not_a_500(server: LaunchedServer, model: str) -> None:
    body = {"model_id": model, "forward_input": {"data": [diverging_datum()], "loss_fn": "importance_sampling"}}
    with server.client(KEY) as c:
        rid = c.post("/forward", json=body).json()["request_id"]
        r = c.post("/retrieve_future", json={"request_id": rid})
        assert r.status_code == 200, r.text
        loss = r.json()["metrics"]["loss:sum"]
        assert loss in ("NaN", "Infinity", "-Infinity"), r.json()["metrics"]
        proto = c.post("/retrieve_future", json={"request_id": rid}, headers={"accept": "application/x-protobuf"})
        assert proto.status_code == 200 and proto.headers["content-type"] == "application/x-protobuf"


def test_the_tinker_sdk_reads_a_non_finite_result(server: LaunchedServer, model: str) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bounded-sdk")
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=4).result()
    inputs: Any = {"target_tokens": [2, 3, 4], "logprobs": [-1e30] * 3, "advantages": [1.0, -1.0, 1.0]}
    data = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)]
    out = training.forward(data, "importance_sampling").result(timeout=60)
    assert not all(map(lambda v: v == v and abs(v) != float("inf"), out.metrics.values())), out.metrics


@pytest.mark.parametrize(("ids", "labels", "fragment"), [
    ([5, 10**6, 7], [5, 6, 7], "outside the vocabulary"),
    ([5, 6, 7], [5, 10**6, 7], "outside the vocabulary"),
    ([5, 10**20, 7], [5, 6, 7], "input_ids"),
    ([5, 6, 7], [5, -7, 7], "labels"),
    ([5, 6, 7], [5, "x", 7], "labels"),
])
@pytest.mark.parametrize("backend", ["mock", "transformers"])
def test_the_twinkle_routes_refuse_token_ids_outside_the_vocabulary(request: pytest.FixtureRequest, backend: str,
                                                                    ids: list[Any], labels: list[Any],
                                                                    fragment: str) -> None:
    server: LaunchedServer = request.getfixturevalue("server" if backend == "mock" else "transformers_server")
    with server.client(KEY) as c:
        model = new_model(c)
        for route in ("/twinkle/forward_backward", "/twinkle/forward_only"):
            r = c.post(route, json={"model_id": model, "inputs": [{"input_ids": ids, "labels": labels}]})
            assert r.status_code == 400 and fragment in r.json()["error"], (route, r.text)


@pytest.mark.parametrize("backend", ["mock", "transformers"])
def test_a_full_or_read_only_checkpoint_disk_fails_the_save_saying_so(request: pytest.FixtureRequest,
                                                                      backend: str) -> None:
    server: LaunchedServer = request.getfixturevalue("server" if backend == "mock" else "transformers_server")
    with server.client(KEY) as c:
        model = new_model(c)
    tenant_dir = Path(server.config["storage"]["checkpoint_dir"]) / tenant_id(KEY)
    tenant_dir.mkdir(parents=True, exist_ok=True)
    if os.system(f"mount -t tmpfs -o size=64k tmpfs {tenant_dir} 2>/dev/null") != 0:
        pytest.skip("mounting a tmpfs needs CAP_SYS_ADMIN; the unit tests cover the error mapping")
    try:
        with (tenant_dir / "filler").open("wb", buffering=0) as filler:  # fill the disk for real
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass
        with server.client(KEY) as c:
            full = wait(c, c.post("/save_weights", json={"model_id": model, "path": "on-full"}).json()["request_id"])
            assert full["code"] == "storage_unavailable" and "is full" in full["error"], full
            assert "OSError" not in full["error"] and str(tenant_dir) not in full["error"]
            assert c.post("/optim_step", json={"model_id": model, "adam_params": {}}).status_code == 200  # still trains
            assert os.system(f"mount -o remount,ro {tenant_dir}") == 0
            ro = wait(c, c.post("/save_weights", json={"model_id": model, "path": "on-ro"}).json()["request_id"])
            assert ro["code"] == "storage_unavailable" and "read-only" in ro["error"], ro
    finally:
        os.system(f"umount {tenant_dir}")
