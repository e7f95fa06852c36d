"""Limits end to end: rates per key answered with 429 + Retry-After and recovering, the largest request,
`paused_rate_limit` in try_again, models per key under concurrent creates, and the SDK backing off."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from api.tarpit import FREE_BURST, FREE_PER_SECOND
from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.harness import LaunchedServer, launch

pytestmark = pytest.mark.e2e

RPS, TPS, MAX_INPUT = 10, 4000, 3000  # per key, over a 1 s window
MODELS_PER_KEY = 3


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server = launch(tmp_path_factory.mktemp("limits"), tiny_model_dir, db=3,
                    queue_config={"rps_limit": RPS, "tps_limit": TPS, "max_input_tokens": MAX_INPUT},
                    server_config={"per_token_model_limit": MODELS_PER_KEY},
                    env={"TWINKLE_LONG_POLL_SECONDS": "0.3"})
    yield server
    server.stop()


def optim(c: httpx.Client, model: str) -> httpx.Response:
    return c.post("/optim_step", json={"model_id": model, "adam_params": {"learning_rate": 0.01}})


def burst(c: httpx.Client, send: Callable[[httpx.Client], httpx.Response], n: int = 3 * RPS
          ) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """`n` requests at once, so that they land inside one window even on a slow machine; returns the
    admitted and the refused answers, in the order they were sent."""
    started = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda _: send(c), range(n)))
    admitted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    assert refused, f"{n} requests at once were all admitted with rps_limit {RPS}"
    if time.monotonic() - started < 1:  # the whole burst fell inside one window
        assert len(admitted) <= RPS
    return admitted, refused


def rejections(server: LaunchedServer) -> dict[str, int]:
    raw = server.redis.hgetall(server.keys.rate_rejections())
    return {cast(bytes, k).decode(): int(v) for k, v in raw.items()}


def test_requests_over_the_rate_get_429_with_retry_after_and_then_recover(limited_server: LaunchedServer) -> None:
    with limited_server.client("tml-rate") as c, limited_server.client("tml-bystander") as other:
        model = new_model(c)
        bystander = new_model(other)
        before = rejections(limited_server).get("models-tiny:requests", 0)
        admitted, refusals = burst(c, lambda c: optim(c, model))
        accepted = [a.json()["request_id"] for a in admitted]
        refused = refusals[0]
        assert refused.status_code == 429, refused.text
        body = refused.json()
        assert body["code"] == "rate_limited" and f"{RPS} requests/s" in body["error"]
        assert int(refused.headers["Retry-After"]) >= 1
        wait_ms = int(refused.headers["Retry-After-Ms"])
        assert 0 < wait_ms <= 1000 and body["details"]["retry_after"] == pytest.approx(wait_ms / 1000, abs=0.002)
        assert optim(other, bystander).status_code == 200  # another key is not limited by this one
        time.sleep(wait_ms / 1000 + 0.05)
        assert optim(c, model).status_code == 200
        assert rejections(limited_server)["models-tiny:requests"] > before
        assert all("error" not in wait(c, rid) for rid in accepted)


def test_input_tokens_are_limited_per_request_and_per_second(limited_server: LaunchedServer) -> None:
    with limited_server.client("tml-tokens") as c:
        model = new_model(c)
        long = datum([(i % 90) + 2 for i in range(1601)])
        too_big = c.post("/forward_backward", json=fb_body(model, [long, long]))
        assert too_big.status_code == 400, too_big.text
        assert "3200 input tokens" in too_big.json()["error"] and "at most 3000" in too_big.json()["error"]
        assert too_big.json()["details"] == {"input_tokens": 3200, "max_input_tokens": MAX_INPUT}
        batch = [datum([(i % 90) + 2 for i in range(1001)]) for _ in range(2)]  # 2000 input tokens
        admitted, refused = burst(c, lambda c: c.post("/forward_backward", json=fb_body(model, batch)), n=3)
        assert len(admitted) == 2  # 4000 tokens fit the window; RPS would admit all three
        third = refused[0]
        assert third.status_code == 429 and "input tokens/s" in third.json()["error"], third.text
        time.sleep(int(third.headers["Retry-After-Ms"]) / 1000 + 0.05)
        assert c.post("/forward_backward", json=fb_body(model, batch)).status_code == 200


def test_sampling_is_limited_too(limited_server: LaunchedServer) -> None:
    # no sampler pool in this config: the model pool samples, under its queue_config
    body = {"base_model": "tiny-qwen", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 2}}
    with limited_server.client("tml-sampling") as c:
        _, refused = burst(c, lambda c: c.post("/asample", json=body))
        assert {r.status_code for r in refused} == {429}


def test_try_again_reports_paused_rate_limit_while_the_key_is_over_its_limit(
        limited_server: LaunchedServer) -> None:
    with limited_server.client("tml-paused") as c, limited_server.client("tml-calm") as calm:
        model = new_model(c)
        calm_model = new_model(calm)
        time.sleep(1.05)  # create_model counts against the rate too: the burst below starts a fresh window
        worker = limited_server.worker_pid()
        os.kill(worker, signal.SIGSTOP)  # hold the queue so the futures stay pending
        try:
            admitted, refused = burst(c, lambda c: optim(c, model))
            assert {r.status_code for r in refused} == {429}
            accepted = [a.json()["request_id"] for a in admitted]
            polled = c.post("/retrieve_future", json={"request_id": accepted[-1]}).json()
            assert polled["type"] == "try_again" and polled["queue_state"] == "paused_rate_limit", polled
            assert "requests/s" in polled["queue_state_reason"] and "queued" in polled["queue_state_reason"]
            calm_rid = optim(calm, calm_model).json()["request_id"]
            calm_polled = calm.post("/retrieve_future", json={"request_id": calm_rid}).json()
            assert calm_polled["queue_state"] == "active", calm_polled
        finally:
            os.kill(worker, signal.SIGCONT)
        time.sleep(1.05)
        assert "error" not in wait(c, accepted[-1])


def test_per_key_model_limit_holds_under_twenty_concurrent_creates(limited_server: LaunchedServer) -> None:
    with limited_server.client("tml-quota") as c:
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]

        def create(_: int) -> httpx.Response:
            with limited_server.client("tml-quota") as own:
                return own.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen",
                                                       "lora_config": {"rank": 4}})

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(create, range(20)))
        created = [a.json()["model_id"] for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code != 200]
        assert len(created) == MODELS_PER_KEY, [a.text for a in answers]
        # create_model counts against the request rate too: twenty at once hit both limits
        assert all(a.status_code == 429 and a.json()["code"] in ("limit_exceeded", "rate_limited") for a in refused)
        over_quota = [a for a in refused if a.json()["code"] == "limit_exceeded"]
        assert f"already has {MODELS_PER_KEY} active models" in over_quota[0].json()["error"]
        assert "Unload a model" in over_quota[0].json()["error"]
        assert limited_server.redis.scard(limited_server.keys.owner_models(_tenant(c, created[0]))) == MODELS_PER_KEY
        for answer in answers:
            if answer.status_code == 200:
                assert "error" not in wait(c, answer.json()["request_id"])
        assert c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen"}).status_code == 429
        time.sleep(1.05)  # the burst's window passes
        unloaded = c.post("/unload_model", json={"model_id": created[0]})
        assert unloaded.status_code == 200
        again = c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen", "lora_config": {"rank": 4}})
        assert again.status_code == 200, again.text
        assert "error" not in wait(c, again.json()["request_id"])


def test_the_tinker_sdk_backs_off_on_429_and_every_step_completes(limited_server: LaunchedServer) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=limited_server.base_url, api_key="tml-sdk-limited")
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=4).result()
    inputs: Any = {"target_tokens": [4, 5, 6, 7], "weights": [1.0, 1.0, 1.0, 1.0]}  # the SDK converts lists
    data = [types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5, 6]), loss_fn_inputs=inputs)]
    before = rejections(limited_server).get("models-tiny:requests", 0)
    futures: list[Any] = []
    for _ in range(2 * RPS):
        futures.append(training.forward_backward(data, "cross_entropy"))
        futures.append(training.optim_step(types.AdamParams(learning_rate=1e-3)))
    results = [f.result() for f in futures]
    assert all(r.metrics for r in results)
    assert rejections(limited_server).get("models-tiny:requests", 0) > before  # it was refused and retried


def _tenant(c: httpx.Client, model_id: str) -> str:
    info = c.get(f"/training_runs/{model_id}").json()
    return str(info["model_owner"])


def test_the_twinkle_native_routes_are_limited_too(limited_server: LaunchedServer) -> None:
    with limited_server.client("tml-limit-twinkle") as c:
        model = new_model(c)
        feature = {"input_ids": list(range(5, 25)), "labels": [-100, -100, *range(7, 25)]}
        _, refused = burst(c, lambda c: c.post("/twinkle/forward_backward",
                                               json={"model_id": model, "inputs": [feature]}))
        assert {r.status_code for r in refused} == {429}
        assert all(r.headers.get("Retry-After") for r in refused)
        ids = [(i % 400) + 5 for i in range(MAX_INPUT + 1)]  # in the vocabulary, one token too many
        too_long = {"input_ids": ids, "labels": ids}
        over = c.post("/twinkle/forward_only", json={"model_id": model, "inputs": [too_long]})
        assert over.status_code == 400 and "input tokens" in over.json()["error"], over.text
        time.sleep(1.1)  # the window passed: served again
        ok = c.post("/twinkle/forward_backward", json={"model_id": model, "inputs": [feature]})
        assert ok.status_code == 200, ok.text
        assert "loss" in wait(c, ok.json()["request_id"])


COSTLY: list[tuple[str, Callable[[str, str, str], dict[str, Any]]]] = [
    ("/save_weights", lambda model, sid, path: {"model_id": model}),
    ("/save_weights_for_sampler", lambda model, sid, path: {"model_id": model}),
    ("/load_weights", lambda model, sid, path: {"model_id": model, "path": path}),
    ("/create_model", lambda model, sid, path: {"session_id": sid, "base_model": "tiny-qwen"}),
    ("/unload_model", lambda model, sid, path: {"model_id": model}),
    ("/twinkle/save", lambda model, sid, path: {"model_id": model, "name": "flood"}),
    ("/twinkle/resume_from_checkpoint", lambda model, sid, path: {"model_id": model, "path": path}),
    ("/copy_weights", lambda model, sid, path: {"source_path": path, "destination_project_id": "flood"}),
    ("/save_weights_external", lambda model, sid, path: {"model_id": model, "path": f"x{time.time_ns()}"}),
]


def fill_window(c: httpx.Client, model: str) -> None:
    """Bursts of optim_step until the key's window is full for at least another 150 ms. A burst is a little over
    the rate, so that its few refusals stay within the key's free allowance: a held one (api.tarpit) comes back
    a second later, when the window has moved on."""
    for _ in range(20):
        with ThreadPoolExecutor(RPS + 2) as pool:
            answers = list(pool.map(lambda _: optim(c, model), range(RPS + 2)))
        waits = [int(a.headers["Retry-After-Ms"]) for a in answers if a.status_code == 429]
        if waits and min(waits) >= 150:
            return
    pytest.fail("could not fill the rate window (machine too slow?)")


@pytest.mark.parametrize(("path", "body"), COSTLY, ids=[p for p, _ in COSTLY])
def test_every_costly_route_counts_against_the_keys_rate(limited_server: LaunchedServer, path: str,
                                                         body: Callable[[str, str, str], dict[str, Any]]) -> None:
    with limited_server.client(f"tml-costly-{path.strip('/').replace('/', '-')}") as c:
        model = new_model(c)
        sid = c.post("/create_session", json={}).json()["session_id"]
        saved = wait(c, c.post("/save_weights", json={"model_id": model}).json()["request_id"])["path"]
        fill_window(c, model)
        r = c.post(path, json=body(model, sid, saved))
        assert r.status_code == 429 and r.json()["code"] == "rate_limited", r.text
        assert int(r.headers["Retry-After"]) >= 1
        time.sleep(int(r.headers["Retry-After-Ms"]) / 1000 + 0.05)
        assert c.post(path, json=body(model, sid, saved)).status_code == 200  # and served once it fits


def test_a_key_flooding_saves_gets_429_while_another_key_saves_freely(limited_server: LaunchedServer) -> None:
    with limited_server.client("tml-save-flood") as c, limited_server.client("tml-save-calm") as calm:
        model, calm_model = new_model(c), new_model(calm)
        worker = limited_server.worker_pid()
        os.kill(worker, signal.SIGSTOP)  # saves stay queued: the key's outstanding saves pile up
        try:
            answers = [c.post("/save_weights", json={"model_id": model}) for _ in range(4)]
            assert [a.status_code for a in answers] == [200, 200, 429, 429], [a.text for a in answers]
            refused = answers[2].json()
            assert refused["code"] == "rate_limited" and "2 checkpoint saves queued or running" in refused["error"]
            assert int(answers[2].headers["Retry-After"]) >= 1
            assert calm.post("/save_weights", json={"model_id": calm_model}).status_code == 200
        finally:
            os.kill(worker, signal.SIGCONT)
        for answer in answers[:2]:
            assert "path" in wait(c, answer.json()["request_id"])
        time.sleep(1.05)
        again = c.post("/save_weights", json={"model_id": model})  # the saves ended: room again
        assert again.status_code == 200, again.text


def test_the_tinker_sdk_retries_saves_refused_by_the_cap_and_every_one_completes(
        limited_server: LaunchedServer) -> None:
    import tinker

    service = tinker.ServiceClient(base_url=limited_server.base_url, api_key="tml-sdk-saves")
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=4).result()
    worker = limited_server.worker_pid()
    os.kill(worker, signal.SIGSTOP)  # the first saves stay queued, so the later ones meet the cap
    try:
        futures = [training.save_state(f"pipelined-{i}") for i in range(5)]
        time.sleep(2)
    finally:
        os.kill(worker, signal.SIGCONT)
    paths = [f.result(timeout=120).path for f in futures]
    assert paths == [f"tinker://{training.model_id}/weights/pipelined-{i}" for i in range(5)]


def test_a_key_that_keeps_hammering_after_its_429s_gets_them_slowly_and_others_are_answered_at_once(
        limited_server: LaunchedServer) -> None:
    with limited_server.client("tml-hammer") as hammer, limited_server.client("tml-bystander") as bystander:
        model, other = new_model(hammer), new_model(bystander)
        stop = time.monotonic() + 3
        slowest: list[float] = []

        def keep_sending(_: int) -> int:  # ignores every Retry-After
            sent = 0
            while time.monotonic() < stop:
                began = time.monotonic()
                answer = optim(hammer, model)
                if answer.status_code == 429:
                    slowest.append(time.monotonic() - began)
                sent += 1
            return sent

        with ThreadPoolExecutor(8) as pool:
            sending = pool.map(keep_sending, range(8))
            time.sleep(1.5)
            began = time.monotonic()
            assert optim(bystander, other).status_code == 200
            assert time.monotonic() - began < 0.5  # nobody else waits behind the held answers
            sent = sum(sending)
    assert max(slowest) >= 0.9  # held for the penalty (1 s)
    # in 3 s: the free allowance (its burst and 3 s of refill), about two held answers per sender and second
    # (penalties of 0.5-1.5 s), and what the rate admits; without the tarpit the 8 senders get thousands
    assert sent <= FREE_BURST + 3 * FREE_PER_SECOND + 8 * 3 * 2 + 4 * RPS, sent
