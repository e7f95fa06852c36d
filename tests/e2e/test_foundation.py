"""The foundation slice end to end: a launched server, real Redis, real Celery workers, real HTTP."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx
import pytest

from tests.harness import LaunchedServer
from twinkle.futures import FutureRecord

pytestmark = pytest.mark.e2e


def datum(tokens: list[int]) -> dict[str, Any]:
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"},
                           "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"}},
    }


def fb_body(model_id: str, data: list[dict[str, Any]], seq_id: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model_id": model_id, "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"}}
    if seq_id is not None:
        body["seq_id"] = seq_id
    return body


def wait(c: httpx.Client, request_id: str) -> dict[str, Any]:
    while True:
        r = c.post("/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        if body.get("type") != "try_again":
            return body


def new_model(c: httpx.Client, rank: int = 4) -> str:
    sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    r = c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen", "lora_config": {"rank": rank}})
    assert r.status_code == 200, r.text
    assert wait(c, r.json()["request_id"])["model_id"] == r.json()["model_id"]
    return str(r.json()["model_id"])


def assert_pipelined_ops_keep_each_adapters_order(server: LaunchedServer, key: str, rounds: int,
                                                  optim_every: int) -> None:
    """Four adapters of `key` get `rounds` ops each, sent without waiting, the adapters taking turns (an
    optim_step every `optim_every`th round, a forward_backward otherwise): every op succeeds, and each
    adapter's ops ran once each, in the order they were sent."""
    with server.client(key) as c:
        models = [new_model(c) for _ in range(4)]
        submitted: dict[str, list[str]] = {m: [] for m in models}
        for i in range(rounds):
            for m in models:
                if i % optim_every == optim_every - 1:
                    r = c.post("/optim_step", json={"model_id": m, "adam_params": {"learning_rate": 0.01}})
                else:
                    r = c.post("/forward_backward", json=fb_body(m, [datum([3, 4, 5, 6, 7 + i % 5])]))
                submitted[m].append(r.json()["request_id"])
        for m in models:
            results = [wait(c, rid) for rid in submitted[m]]
            assert all("error" not in r for r in results)
            records = [FutureRecord.from_hash(server.redis.hgetall(server.keys.future(rid))) for rid in submitted[m]]
            executed = [r.exec_index for r in records]
            assert executed == sorted(executed) and len(set(executed)) == rounds


def test_training_through_http_lowers_the_loss(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-loss") as c:
        model = new_model(c)
        data = [datum([5 + (i * 7) % 50 for i in range(k, k + 24)]) for k in range(4)]
        losses = []
        for _ in range(15):
            fb = c.post("/forward_backward", json=fb_body(model, data)).json()["request_id"]
            opt = c.post("/optim_step", json={"model_id": model, "adam_params": {"learning_rate": 0.05}}).json()
            losses.append(wait(c, fb)["metrics"]["loss:sum"])
            assert "grad_norm:mean" in wait(c, opt["request_id"])["metrics"]
        assert losses[-1] < 0.5 * losses[0], losses
        saved = wait(c, c.post("/save_weights", json={"model_id": model, "path": "loop-1"}).json()["request_id"])
        assert saved["path"] == f"tinker://{model}/weights/loop-1"


def test_pipelined_ops_on_four_adapters_run_in_per_adapter_order(mock_server: LaunchedServer) -> None:
    assert_pipelined_ops_keep_each_adapters_order(mock_server, "tml-order", rounds=50, optim_every=2)


def test_a_retried_submit_returns_the_same_request_and_runs_once(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-retry") as c:
        model = new_model(c)
        body = fb_body(model, [datum([1, 2, 3, 4])], seq_id=1)
        first = c.post("/forward_backward", json=body).json()["request_id"]
        second = c.post("/forward_backward", json=body).json()["request_id"]
        assert first == second
        wait(c, first)
        ops = int(mock_server.redis.hget(mock_server.keys.model(model), "ops_executed") or 0)
        assert ops == 2  # create_model + one forward_backward


def test_long_poll_returns_promptly_when_the_future_completes(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-poll") as c:
        model = new_model(c)
        big = [datum([(7 * i) % 500 + 3 for i in range(1500)]) for _ in range(24)]
        rid = c.post("/forward_backward", json=fb_body(model, big)).json()["request_id"]
        c.post("/retrieve_future", json={"request_id": rid})  # waits for completion
        answered = time.time()
        record = FutureRecord.from_hash(mock_server.redis.hgetall(mock_server.keys.future(rid)))
        assert record.finished_at > 0
        # woken by pub/sub, not by the 5 s re-check timer
        assert answered - record.finished_at < 0.5


def test_a_future_of_another_key_is_not_found(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-owner") as owner, mock_server.client("tml-intruder") as intruder:
        model = new_model(owner)
        rid = owner.post("/forward_backward", json=fb_body(model, [datum([1, 2, 3])])).json()["request_id"]
        assert intruder.post("/retrieve_future", json={"request_id": rid}).status_code == 404
        assert intruder.post("/forward_backward", json=fb_body(model, [datum([1, 2, 3])])).status_code == 404
        assert intruder.post("/get_info", json={"model_id": model}).status_code == 404
        assert "error" not in wait(owner, rid)


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/forward_backward", {"model_id": "nope:train:0", "forward_backward_input": {"data": [], "loss_fn": "x"}},
         "empty"),
        ("/optim_step", {"model_id": "nope:train:0", "adam_params": {"learning_rate": -1}}, "learning_rate"),
        ("/create_model", {"session_id": "missing", "base_model": "tiny-qwen"}, "not found"),
        ("/retrieve_future", {"request_id": 42}, "request_id"),
    ],
)
def test_bad_input_gets_a_4xx_with_a_clear_message(mock_server: LaunchedServer, path: str, body: dict[str, Any],
                                                    fragment: str) -> None:
    with mock_server.client("tml-bad") as c:
        r = c.post(path, json=body)
        assert 400 <= r.status_code < 500, r.text
        assert fragment.lower() in r.json()["error"].lower()
        assert "Traceback" not in r.text
        assert c.get("/healthz").status_code == 200


def test_bad_batches_are_refused_before_they_reach_the_worker(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-bad2") as c:
        model = new_model(c)
        wrong_shape = datum([1, 2, 3, 4])
        wrong_shape["loss_fn_inputs"]["weights"]["data"] = [1.0]
        cases = [
            (fb_body("unknown:train:9", [datum([1, 2, 3])]), 404),
            (fb_body(model, [wrong_shape]), 400),
            (fb_body(model, []), 400),
            (fb_body(model, [datum([1, 2, 10**6])]), 400),
        ]
        for body, status in cases:
            r = c.post("/forward_backward", json=body)
            assert r.status_code == status, r.text
            assert r.json()["category"] == "user"
        r = c.post("/forward_backward", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = c.post("/forward_backward", content=b"x" * (65 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 413
        fb = c.post("/forward_backward", json=fb_body(model, [datum([1, 2, 3])])).json()["request_id"]
        assert "metrics" in wait(c, fb)


def test_a_killed_worker_is_restarted_and_its_running_future_fails_naming_the_checkpoint(
        mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-crash") as c:
        model = new_model(c)
        wait(c, c.post("/save_weights", json={"model_id": model, "path": "before-crash"}).json()["request_id"])
        big = [datum([(7 * i) % 500 + 3 for i in range(2000)]) for _ in range(64)]
        rid = c.post("/forward_backward", json=fb_body(model, big)).json()["request_id"]
        queued_after = c.post("/optim_step", json={"model_id": model, "adam_params": {}}).json()["request_id"]
        # queued behind the crash too: another adapter's first ops, which must all run, in acceptance order
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        late = c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen",
                                             "lora_config": {"rank": 4}}).json()
        late_ops = [late["request_id"],
                    c.post("/forward_backward", json=fb_body(late["model_id"], [datum([1, 2, 3, 4])])).json()[
                        "request_id"],
                    c.post("/optim_step", json={"model_id": late["model_id"], "adam_params": {}}).json()["request_id"]]
        deadline = time.time() + 30
        while mock_server.redis.hget(mock_server.keys.future(rid), "status") != b"running":
            assert time.time() < deadline, "the op never started"
            time.sleep(0.005)
        os.kill(mock_server.worker_pid(), signal.SIGKILL)
        failed = wait(c, rid)
        assert failed["category"] == "server"
        assert f"tinker://{model}/weights/before-crash" in failed["error"]
        nxt = wait(c, queued_after)
        assert nxt["category"] == "server" and "before-crash" in nxt["error"]
        assert all("error" not in wait(c, request_id) for request_id in late_ops)
        # the other adapter's ops ran in acceptance order; the lost one's queued op failed while still queued
        # (workers/lost_adapters.py), never begun
        started = [float(mock_server.redis.hget(mock_server.keys.future(request_id), "started_at") or 0)
                   for request_id in late_ops]
        assert started == sorted(started) and min(started) > 0
        # the restarted worker serves other adapters, and this one can resume from its checkpoint
        other = new_model(c)
        assert "metrics" in wait(c, c.post("/forward_backward", json=fb_body(other, [datum([1, 2, 3])])).json()[
            "request_id"])
        load = c.post("/load_weights", json={"model_id": model, "path": f"tinker://{model}/weights/before-crash",
                                              "optimizer": True})
        assert "error" not in wait(c, load.json()["request_id"])
        assert "metrics" in wait(c, c.post("/forward_backward", json=fb_body(model, [datum([1, 2, 3])])).json()[
            "request_id"])
        assert "restarting" in mock_server.log()
