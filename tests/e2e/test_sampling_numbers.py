"""Sampling numbers through a launched server and the real Tinker SDK: the sampler's logprobs are the ones the
training pool's `forward` computes for the same tokens on the same weights, and top-k logprobs (prompt and
sampled) reach the SDK. Mock and transformers (torch sampler pool)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from tests.harness import LaunchedServer

pytestmark = pytest.mark.e2e
BASE = "tiny-qwen"
CYCLE = [10, 11, 12, 13, 14] * 5


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


@pytest.fixture(scope="module")
def trained(server: LaunchedServer) -> Iterator[tuple[tinker.TrainingClient, tinker.SamplingClient]]:
    """A training client a few steps into learning CYCLE, and a sampling client of its current weights."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-sampling-numbers")
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    for _ in range(3):
        training.forward_backward([datum(CYCLE)], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=0.02)).result()
    yield training, training.save_weights_and_get_sampling_client().result()


def test_sampled_logprobs_equal_the_training_forwards_for_concurrent_requests(
    trained: tuple[tinker.TrainingClient, tinker.SamplingClient],
) -> None:
    training, sampling = trained
    prompts = [CYCLE[:2], CYCLE[3:10], [7], CYCLE[1:5]]
    params = [types.SamplingParams(max_tokens=6, temperature=t, top_k=k, seed=i)
              for i, (t, k) in enumerate([(1.0, -1), (0.7, 5), (1.3, -1), (0.0, -1)])]
    # submitted together, so a sampler pool batches them (joins included)
    futures = [sampling.sample(types.ModelInput.from_ints(p), 2, sp) for p, sp in zip(prompts, params, strict=True)]
    gaps = []
    for prompt, future in zip(prompts, futures, strict=True):
        for sequence in future.result().sequences:
            tokens = prompt + list(sequence.tokens)
            forward = training.forward([datum(tokens)], "cross_entropy").result()
            expected = forward.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
            gaps.append(float(np.abs(np.asarray(sequence.logprobs) - expected).max()))
    assert max(gaps) < 1e-4, gaps


def test_top_k_prompt_and_sampled_logprobs_reach_the_sdk(
    trained: tuple[tinker.TrainingClient, tinker.SamplingClient],
) -> None:
    _, sampling = trained
    prompt = CYCLE[:6]
    response = sampling.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=1),
                               include_prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2).result()

    assert response.prompt_logprobs is not None and response.topk_prompt_logprobs is not None
    assert response.topk_prompt_logprobs[0] is None and len(response.topk_prompt_logprobs) == len(prompt)
    for position, top in enumerate(response.topk_prompt_logprobs[1:], start=1):
        assert top is not None and len(top) == 3
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        own = response.prompt_logprobs[position]
        assert own is not None and values[0] >= own - 1e-6
        if prompt[position] in dict(top):
            assert dict(top)[prompt[position]] == pytest.approx(own, abs=1e-5)
    sequence = response.sequences[0]
    assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens)
    for token, logprob, top in zip(sequence.tokens, sequence.logprobs or [], sequence.topk_logprobs, strict=True):
        assert top is not None and len(top) == 2 and top[0][1] >= logprob - 1e-6
        if token in dict(top):
            assert dict(top)[token] == pytest.approx(logprob, abs=1e-5)


def test_compute_logprobs_scores_only_the_last_n_prompt_tokens_when_asked(
    trained: tuple[tinker.TrainingClient, tinker.SamplingClient],
) -> None:
    _, sampling = trained
    prompt = types.ModelInput.from_ints(CYCLE[:8])
    whole = sampling.compute_logprobs(prompt).result()
    last = sampling.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert last[:5] == [None] * 5
    np.testing.assert_allclose(np.asarray(last[5:], dtype=float), np.asarray(whole[5:], dtype=float), atol=1e-6)
