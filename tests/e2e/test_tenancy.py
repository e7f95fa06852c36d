"""Tiers end to end: each key's weight on its ops' future records (changed in the keys file, applied without a
restart), quotas that make the unmodified Tinker SDK raise at once, and the tier's cap on training runs."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.harness import LaunchedServer, free_port, mock_config
from tests.private_redis import PrivateRedis
from twinkle.auth import tenant_id
from twinkle.futures import FutureRecord, new_request_id
from twinkle.keys_file import add_key
from twinkle.server.cli import main as cli
from twinkle.usage import UsageLedger

pytestmark = pytest.mark.e2e
BASE = "tiny-qwen"
TIERS = {
    "standard": {},
    "gold": {"weight": 3},
    "capped": {"max_training_runs": 1,
               "quotas": {"trained_tokens": {"day": 100}, "sampled_tokens": {"month": 10}}},
}
LABELS = {"plain": "", "gold": "gold", "changing": "", "capped": "capped", "runs": "capped"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tenancy-keys") / "keys"


@pytest.fixture(scope="module")
def raw_keys(keys_file: Path) -> dict[str, str]:
    return {label: add_key(keys_file, label, prefix="tml-", tier=tier)[0] for label, tier in LABELS.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, keys_file: Path,
           raw_keys: dict[str, str]) -> Iterator[LaunchedServer]:
    tmp = tmp_path_factory.mktemp("tenancy")
    broker = PrivateRedis(tmp / "redis")  # every database of the shared Redis is taken by other modules
    broker.start()
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=0, sampler=True,
                         server_config={"per_token_model_limit": 3}, auth={"keys_file": str(keys_file)})
    config["broker"]["url"] = broker.url
    config["tenancy"] = {"default_tier": "standard", "tiers": TIERS}
    launched = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log")
    launched.start()
    yield launched
    launched.stop()
    broker.kill()


def weight_of(server: LaunchedServer, request_id: str) -> float:
    raw = server.redis.hgetall(server.keys.future(request_id))
    return FutureRecord.from_hash(raw).weight


def optim(c: httpx.Client, model: str) -> str:
    r = c.post("/optim_step", json={"model_id": model, "adam_params": {"learning_rate": 0.01}})
    assert r.status_code == 200, r.text
    return str(r.json()["request_id"])


def use(server: LaunchedServer, key: str, amounts: dict[str, int]) -> None:
    """Usage as a pool records it when one of the key's ops completes."""
    rec = FutureRecord(request_id=new_request_id(), op="forward_backward", owner=tenant_id(key), model_id="run",
                       queue="model.models-tiny.0")
    server.redis.hset(server.keys.future(rec.request_id), mapping=rec.to_hash())
    assert UsageLedger(server.redis, server.keys).record(rec, BASE, amounts)


def within(seconds: float, condition: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.2)
    raise AssertionError(f"not within {seconds} s")


def test_the_weight_of_a_keys_tier_is_on_the_future_record_of_every_op_it_submits(
        server: LaunchedServer, raw_keys: dict[str, str]) -> None:
    with server.client(raw_keys["gold"]) as gold, server.client(raw_keys["plain"]) as plain:
        model = new_model(gold)
        fb = gold.post("/forward_backward", json=fb_body(model, [datum([1, 2, 3, 4])])).json()["request_id"]
        step = optim(gold, model)
        assert weight_of(server, fb) == weight_of(server, step) == 3.0
        assert "error" not in wait(gold, step)
        assert weight_of(server, optim(plain, new_model(plain))) == 1.0


def test_a_weight_set_with_the_cli_applies_to_the_next_request_without_a_restart(
        server: LaunchedServer, raw_keys: dict[str, str], keys_file: Path) -> None:
    with server.client(raw_keys["changing"]) as c:
        model = new_model(c)
        assert weight_of(server, optim(c, model)) == 1.0
        assert cli(["keys", "set", "changing", "--weight", "5", "--keys-file", str(keys_file)]) == 0
        within(5, lambda: weight_of(server, optim(c, model)) == 5.0)
        assert cli(["keys", "set", "changing", "--tier", "gold", "--weight", "0", "--keys-file", str(keys_file)]) == 0
        within(5, lambda: weight_of(server, optim(c, model)) == 3.0)  # the gold tier's weight


def test_a_used_up_quota_makes_the_tinker_sdk_raise_at_once_naming_used_limit_and_reset(
        server: LaunchedServer, raw_keys: dict[str, str]) -> None:
    key = raw_keys["capped"]
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    batch = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                         loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})]
    tc.forward_backward(batch, "cross_entropy").result()
    use(server, key, {"trained_tokens": 100})
    started = time.monotonic()
    with pytest.raises(tinker.PermissionDeniedError) as refused:
        tc.forward_backward(batch, "cross_entropy").result()
    assert time.monotonic() - started < 5, "the SDK retried a used-up quota"
    message = str(refused.value)  # what was used: the 100 above and what the first batch trained, if metered
    used = re.search(r"used (\d+) trained_tokens today \(UTC\), and its tier 'capped' allows 100 per UTC day; "
                     r"it resets at (\d{4}-\d\d-\d\dT00:00:00Z)", message)
    assert used and 100 <= int(used.group(1)) <= 103, message
    assert f"Wait until {used.group(2)}, or ask the server operator" in message
    assert tc.forward(batch, "cross_entropy").result().loss_fn_outputs  # a quota on trained tokens only

    sampler = service.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    use(server, key, {"sampled_tokens": 10})
    started = time.monotonic()
    with pytest.raises(tinker.PermissionDeniedError, match=r"used \d+ sampled_tokens this month"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    assert time.monotonic() - started < 5
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.completions.create(model=BASE, prompt="hello", max_tokens=2)
    assert denied.value.code == "quota_exceeded" and "sampled_tokens" in denied.value.message


def test_the_tiers_training_run_cap_refuses_one_more_model_until_one_is_unloaded(
        server: LaunchedServer, raw_keys: dict[str, str]) -> None:
    with server.client(raw_keys["runs"]) as c:
        first = new_model(c)
        sid = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        create = {"session_id": sid, "base_model": BASE, "lora_config": {"rank": 4}}
        refused = c.post("/create_model", json=create)
        assert refused.status_code == 403, refused.text
        body = refused.json()
        assert body["code"] == "quota_exceeded" and body["details"]["limit"] == 1
        assert "1 active training runs" in body["error"] and "'capped' allows 1" in body["error"]
        assert refused.headers["x-should-retry"] == "false"
        wait(c, c.post("/unload_model", json={"model_id": first}).json()["request_id"])
        assert c.post("/create_model", json=create).status_code == 200
