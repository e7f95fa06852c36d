"""Lifecycle: 100 models created, kept alive by heartbeats, then left to expire; afterwards every counter
is back to zero and everything transient carries a TTL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import httpx
import pytest

from tests.e2e.test_foundation import datum, fb_body, wait
from tests.harness import LaunchedServer, launch
from twinkle.auth import tenant_id

pytestmark = pytest.mark.e2e

MODELS = 100
ADAPTER_TIMEOUT = 2.0
KEY = "tml-lifecycle"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    # paging off: max_loras is a hard limit here, so one create too many fails and must leave no trace
    server = launch(tmp_path_factory.mktemp("lifecycle"), tiny_model_dir, db=5, max_loras=MODELS,
                    adapter_config={"adapter_timeout": ADAPTER_TIMEOUT, "page_host_mb": 0, "page_disk_mb": 0})
    yield server
    server.stop()


class Heartbeat:
    """What the SDK does in the background: heartbeat the session while the user's loop runs."""

    def __init__(self, server: LaunchedServer, session_id: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server, session_id), daemon=True)

    def _run(self, server: LaunchedServer, session_id: str) -> None:
        with server.client(KEY) as c:
            while not self.stop.wait(0.3):
                c.post("/session_heartbeat", json={"session_id": session_id})

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def create(c: httpx.Client, session_id: str) -> dict[str, str]:
    r = c.post("/create_model", json={"session_id": session_id, "base_model": "tiny-qwen",
                                      "lora_config": {"rank": 2}})
    assert r.status_code == 200, r.text
    return {"model_id": r.json()["model_id"], **wait(c, r.json()["request_id"])}


def live_models(server: LaunchedServer) -> int:
    return int(server.redis.scard(server.keys.owner_models(tenant_id(KEY))))


def pool_adapters(server: LaunchedServer) -> int:
    """The LoRA slots the model pool reports in use."""
    return int(server.redis.scard(server.keys.pool_adapters("model.models-tiny.0")))


def test_a_hundred_expired_models_leave_every_counter_at_zero(server: LaunchedServer) -> None:
    r = server.redis
    with server.client(KEY) as c:
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        with Heartbeat(server, sid):
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda _: create(c, sid), range(MODELS)))
            assert all("error" not in result for result in results), results[:3]
            models = [result["model_id"] for result in results]
            assert live_models(server) == MODELS and pool_adapters(server) == MODELS
            futures = [c.post("/forward_backward", json=fb_body(m, [datum([1, 2, 3])])).json()["request_id"]
                       for m in models[:10]]
            assert all("metrics" in wait(c, rid) for rid in futures)
            one_too_many = create(c, sid)
            assert "LoRA slots" in one_too_many["error"], one_too_many
            # a create that failed holds neither a slot nor a place in the key's model count
            assert live_models(server) == MODELS and pool_adapters(server) == MODELS
            assert r.hget(server.keys.model(one_too_many["model_id"]), "status") == b"unloaded"
        deadline = time.time() + ADAPTER_TIMEOUT + 15
        while live_models(server) and time.time() < deadline:
            time.sleep(0.2)
        assert live_models(server) == 0 and pool_adapters(server) == 0
        statuses = {r.hget(server.keys.model(m), "status") for m in models}
        assert statuses == {b"unloaded"}
        reasons = {cast(bytes, r.hget(server.keys.model(m), "unload_reason")) for m in models}
        assert all(b"no heartbeat or request" in reason for reason in reasons)
        # an expired adapter answers with why, and its ops never reach the backend
        gone = c.post("/forward_backward", json=fb_body(models[0], [datum([1, 2, 3])]))
        assert gone.status_code == 404 and "unloaded" in gone.json()["error"]
        # capacity is back: max_loras adapters fit again
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        with Heartbeat(server, sid):
            with ThreadPoolExecutor(8) as pool:
                again = list(pool.map(lambda _: create(c, sid), range(MODELS)))
            assert all("error" not in result for result in again), [a for a in again if "error" in a][:3]
            for result in again:
                wait(c, c.post("/unload_model", json={"model_id": result["model_id"]}).json()["request_id"])
        assert live_models(server) == 0 and pool_adapters(server) == 0
        _assert_transient_keys_expire(server, futures)


def _assert_transient_keys_expire(server: LaunchedServer, request_ids: list[str]) -> None:
    r = server.redis
    for rid in request_ids:
        assert 0 < r.ttl(server.keys.future(rid)) <= 86400
        assert 0 < r.ttl(server.keys.blob_out(rid)) <= 86400
        assert not r.exists(server.keys.blob_in(rid))  # the payload goes as soon as the op ran
    must_expire = (b"future:", b"blob:", b"dedupe:", b"session:")
    for key in r.scan_iter(match=b"tw:*", count=1000):
        name = key[len(b"tw:"):]
        if name.startswith(must_expire) or (name.startswith(b"rate:") and name != b"rate:rejections"):
            assert r.ttl(key) != -1, f"{key!r} never expires"  # -2: it expired or was deleted meanwhile


def test_a_session_that_stops_heartbeating_releases_its_model_and_queued_ops_fail_with_the_reason(
        server: LaunchedServer) -> None:
    with server.client(KEY) as c:
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        model = create(c, sid)["model_id"]
        deadline = time.time() + ADAPTER_TIMEOUT + 10
        while server.redis.hget(server.keys.model(model), "status") == b"active" and time.time() < deadline:
            time.sleep(0.2)
        r = c.post("/optim_step", json={"model_id": model, "adam_params": {}})
        assert r.status_code == 404
        assert "no heartbeat or request for 2 s" in r.json()["error"]
        info = httpx.get(f"{server.api}/training_runs/{model}", headers={"X-API-Key": KEY}).json()
        assert info["training_run_id"] == model  # the run's record stays listable after the unload
