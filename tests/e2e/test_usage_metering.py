"""Exact usage metering through a launched server: what tenants send is what the ledger counts, once, across
SDK-style retries, a killed worker and the real Tinker SDK (twinkle/usage.py says what is charged)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import tinker
from tinker import types

from tests.e2e.test_foundation import datum, fb_body, new_model, wait
from tests.harness import LaunchedServer
from twinkle.auth import tenant_id
from twinkle.keys import Keys
from twinkle.usage import UsageKeys, decode_hash

pytestmark = pytest.mark.e2e


def totals(server: LaunchedServer, api_key: str) -> dict[str, int]:
    return decode_hash(server.redis.hgetall(UsageKeys(Keys("")).total(tenant_id(api_key))))


def settled_totals(server: LaunchedServer, api_key: str) -> dict[str, int]:
    """The totals once the pools recorded every finished op (recording follows the outcome by a round trip)."""
    time.sleep(0.3)
    return totals(server, api_key)


def test_tokens_sent_equal_tokens_metered_across_retries_and_a_worker_kill(mock_server: LaunchedServer) -> None:
    key = "tml-metering-kill"
    with mock_server.client(key) as c:
        model = new_model(c)
        sent = 0
        request_ids = []
        for step, length in enumerate((5, 9, 17, 33)):
            body = fb_body(model, [datum(list(range(2, 2 + length)))], seq_id=100 + step)
            first = c.post("/forward_backward", json=body).json()["request_id"]
            retried = c.post("/forward_backward", json=body).json()["request_id"]  # what an SDK retry sends
            assert retried == first
            request_ids.append(first)
            sent += length - 1  # the datum's input is all tokens but the last
        for request_id in request_ids:
            assert "metrics" in wait(c, request_id)
        assert "error" not in wait(c, c.post("/optim_step", json={"model_id": model, "adam_params": {}}).json()[
            "request_id"])

        # an op killed with its worker is charged nothing; the ops after it are charged as they run
        big = c.post("/forward_backward", json=fb_body(model, [datum([(7 * i) % 500 + 3 for i in range(2000)])
                                                               for _ in range(64)])).json()["request_id"]
        deadline = time.time() + 30
        while mock_server.redis.hget(mock_server.keys.future(big), "status") != b"running":
            assert time.time() < deadline, "the op never started"
            time.sleep(0.005)
        os.kill(mock_server.worker_pid(), signal.SIGKILL)
        assert wait(c, big)["code"] == "adapter_state_lost"
        other = new_model(c)
        assert "metrics" in wait(c, c.post("/forward_backward", json=fb_body(other, [datum([1, 2, 3, 4])])).json()[
            "request_id"])
        sent += 3
    used = settled_totals(mock_server, key)
    assert used["trained_tokens"] == sent
    assert used["optim_steps"] == 1
    assert used["pool_ms"] > 0


def test_the_tinker_sdk_s_training_and_sampling_are_metered_exactly(server: LaunchedServer) -> None:
    key = "tml-metering-sdk"
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=4).result()
    tokens = [5 + (i * 3) % 40 for i in range(24)]
    batch = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})] * 3
    for _ in range(2):
        fb = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result()
        opt.result()
    training.forward(batch, "cross_entropy").result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokens[:7])
    out = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=5)).result()
    used = settled_totals(server, key)
    assert used["trained_tokens"] == 2 * 3 * 23
    assert used["forwarded_tokens"] == 3 * 23
    assert used["optim_steps"] == 2
    assert used["sampled_prompt_tokens"] == 7
    assert used["sampled_tokens"] == sum(len(seq.tokens) for seq in out.sequences)
    assert used["checkpoint_bytes"] > 0
