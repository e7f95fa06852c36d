from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from twinkle.backends.base import SamplerBackend
from twinkle.backends.mock import MockBackend
from twinkle.errors import InvalidRequest, NotFound
from twinkle.samplers.mock import MockSampler, NextTokenRows
from twinkle.types import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    LoraSpec,
    SampleRequest,
    SamplingParams,
    chunks_from_tokens,
)

VOCAB = 64
CYCLE = [3, 17, 42, 8, 29]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _request(prompt: list[int], params: SamplingParams = GREEDY, **fields: object) -> SampleRequest:
    return SampleRequest(prompt=chunks_from_tokens(prompt), params=params, **fields)  # type: ignore[arg-type]


def _train_cycle(backend: MockBackend, adapter_id: str = "a", steps: int = 30) -> None:
    sequence = np.array((CYCLE * 8)[:31])
    datum = Datum(chunks_from_tokens(sequence[:-1]), {"target_tokens": sequence[1:]})
    backend.create_adapter(adapter_id, LoraSpec(rank=8, seed=0))
    for _ in range(steps):
        backend.forward_backward(adapter_id, ForwardBackwardInput([datum]))
        backend.optim_step(adapter_id, AdamParams(learning_rate=0.05))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-style model dir whose eos is token 8 and whose tokenizer maps id i to the word `w<i>`."""
    directory = tmp_path_factory.mktemp("tiny-model")
    (directory / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": 8}))
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[MockBackend, Path]:
    """A backend whose adapter `a` learned CYCLE, and that adapter's sampler weights."""
    backend = MockBackend(VOCAB)
    _train_cycle(backend)
    weights = tmp_path_factory.mktemp("sampler_weights")
    backend.save_weights_for_sampler("a", weights)
    return backend, weights


def test_mock_sampler_fulfils_the_sampler_backend_protocol() -> None:
    sampler: SamplerBackend = MockSampler(VOCAB)
    assert sampler.info.vocab_size == VOCAB


def test_greedy_sampling_continues_the_trained_cycle(trained: tuple[MockBackend, Path]) -> None:
    backend, weights = trained
    sampler = MockSampler(VOCAB)

    from_sampler = sampler.sample([_request([3, 17], adapter_path=str(weights))])[0].sequences[0]
    from_backend = backend.sample("a", [_request([3, 17])])[0].sequences[0]

    assert from_sampler.tokens == (CYCLE * 3)[2:14]
    assert from_sampler.stop_reason == "length"
    assert from_backend.tokens == from_sampler.tokens
    np.testing.assert_allclose(from_backend.logprobs, from_sampler.logprobs, rtol=1e-6)


def test_the_base_model_does_not_know_the_cycle(trained: tuple[MockBackend, Path]) -> None:
    backend, _ = trained

    tokens = backend.sample(None, [_request([3, 17])])[0].sequences[0].tokens

    assert tokens != (CYCLE * 3)[2:14]


def test_stop_token_ids_end_the_sample_and_are_included(trained: tuple[MockBackend, Path]) -> None:
    backend, _ = trained
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(29,))

    sequence = backend.sample("a", [_request([3], params)])[0].sequences[0]

    assert sequence.tokens == [17, 42, 8, 29]
    assert sequence.stop_reason == "stop"
    assert len(sequence.logprobs) == 4


def test_eos_from_the_model_config_stops_unless_disabled(
    model_dir: Path, trained: tuple[MockBackend, Path]
) -> None:
    _, weights = trained
    sampler = MockSampler(str(model_dir))
    no_eos = SamplingParams(max_tokens=6, temperature=0.0, stop_at_eos=False)

    at_eos, through_eos = sampler.sample(
        [_request([3], adapter_path=str(weights)), _request([3], no_eos, adapter_path=str(weights))]
    )

    assert at_eos.sequences[0].tokens == [17, 42, 8]
    assert at_eos.sequences[0].stop_reason == "stop"
    assert through_eos.sequences[0].tokens == [17, 42, 8, 29, 3, 17]
    assert through_eos.sequences[0].stop_reason == "length"


def test_stop_strings_are_matched_on_decoded_text(model_dir: Path, trained: tuple[MockBackend, Path]) -> None:
    _, weights = trained
    sampler = MockSampler(str(model_dir))
    params = SamplingParams(
        max_tokens=10, temperature=0.0, stop_strings=("w42 w", "never"), stop_at_eos=False
    )

    sequence = sampler.sample([_request([3], params, adapter_path=str(weights))])[0].sequences[0]

    assert sequence.tokens == [17, 42, 8]  # "w17 w42 w8" is the first text that contains "w42 w"
    assert sequence.stop_reason == "stop"


def test_stop_strings_without_a_tokenizer_are_refused() -> None:
    params = SamplingParams(stop_strings=("\n",))

    with pytest.raises(InvalidRequest, match="Stop strings need a tokenizer"):
        MockSampler(VOCAB).sample([_request([3], params)])


def test_the_same_seed_gives_the_same_samples_and_samples_differ(trained: tuple[MockBackend, Path]) -> None:
    backend, _ = trained
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=123)

    first = backend.sample(None, [_request([3], params, num_samples=4)])[0].sequences
    again = backend.sample(None, [_request([3], params, num_samples=4)])[0].sequences
    other_seed = backend.sample(None, [_request([3], SamplingParams(max_tokens=10, seed=7), num_samples=4)])

    assert len(first) == 4
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert [s.logprobs for s in first] == [s.logprobs for s in again]
    assert len({tuple(s.tokens) for s in first}) == 4
    assert [s.tokens for s in other_seed[0].sequences] != [s.tokens for s in first]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=1.0, seed=5),
                                    SamplingParams(max_tokens=8, temperature=0.6, top_k=4, top_p=0.8, seed=5)],
                         ids=["temperature 1", "temperature 0.6 with top_k and top_p"])
def test_sampled_logprobs_are_the_model_logprobs_whatever_the_sampling_parameters(
    trained: tuple[MockBackend, Path], params: SamplingParams
) -> None:
    backend, _ = trained

    sequence = backend.sample("a", [_request([3], params)])[0].sequences[0]

    tokens = [3, *sequence.tokens]
    datum = Datum(chunks_from_tokens(tokens[:-1]), {"target_tokens": np.array(tokens[1:])})
    forward = backend.forward("a", ForwardBackwardInput([datum])).loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(sequence.logprobs, forward, rtol=1e-5, atol=1e-5)


def test_top_k_1_and_a_tiny_top_p_are_greedy_with_the_models_logprobs() -> None:
    backend = MockBackend(VOCAB)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    top_1 = SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=3)
    tiny_p = SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, seed=3)

    outputs = backend.sample(None, [_request([3], greedy), _request([3], top_1), _request([3], tiny_p)])

    greedy_out, k1, p_small = (output.sequences[0] for output in outputs)
    assert k1.tokens == p_small.tokens == greedy_out.tokens
    assert k1.logprobs == p_small.logprobs == greedy_out.logprobs  # the model's own, not the filtered ones
    assert all(lp < 0 for lp in greedy_out.logprobs)


def test_top_k_samples_only_the_k_most_likely_tokens() -> None:
    backend = MockBackend(VOCAB)
    full = backend.sample(None, [_request([3, 9], topk_prompt_logprobs=VOCAB)])[0]
    best_five = {token for token, _ in full.topk_prompt_logprobs[1][:5]}  # type: ignore[index]
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=5, seed=0)

    drawn = backend.sample(None, [_request([3], params, num_samples=200)])[0].sequences

    assert {s.tokens[0] for s in drawn} <= best_five
    assert len({s.tokens[0] for s in drawn}) > 1
    # Reported logprobs are the model's own, not renormalised over the five.
    model_lp = dict(full.topk_prompt_logprobs[1])  # type: ignore[index]
    for sequence in drawn:
        assert sequence.logprobs[0] == pytest.approx(model_lp[sequence.tokens[0]], abs=1e-5)


def test_each_sampled_token_comes_with_the_models_top_k_at_its_position() -> None:
    backend = MockBackend(VOCAB)
    request = _request([3], SamplingParams(max_tokens=5, temperature=1.0, seed=2), num_samples=2)
    request.topk_sample_logprobs = 3

    for sequence in backend.sample(None, [request])[0].sequences:
        assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens)
        for previous, top in zip([3, *sequence.tokens], sequence.topk_logprobs, strict=False):
            # a bigram model: the distribution after `previous` is the prompt's top-k at position 1
            scored = backend.sample(None, [_request([previous, 0], topk_prompt_logprobs=3)])[0]
            assert scored.topk_prompt_logprobs is not None
            expected = scored.topk_prompt_logprobs[1]
            assert [token for token, _ in top] == [token for token, _ in expected]
            np.testing.assert_allclose([lp for _, lp in top], [lp for _, lp in expected], atol=1e-6)
    assert backend.sample(None, [_request([3])])[0].sequences[0].topk_logprobs is None


def test_prompt_logprobs_agree_with_forward_for_the_same_weights(trained: tuple[MockBackend, Path]) -> None:
    backend, weights = trained
    prompt = [3, 17, 42, 5, 5, 60, 8]

    output = MockSampler(VOCAB).sample(
        [_request(prompt, SamplingParams(max_tokens=1), prompt_logprobs=True, adapter_path=str(weights))]
    )[0]

    datum = Datum(chunks_from_tokens(prompt[:-1]), {"target_tokens": np.array(prompt[1:])})
    forward = backend.forward("a", ForwardBackwardInput([datum])).loss_fn_outputs[0]["logprobs"]
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    np.testing.assert_allclose(output.prompt_logprobs[1:], forward, rtol=1e-5)  # type: ignore[arg-type]
    assert output.topk_prompt_logprobs is None


def test_topk_prompt_logprobs_are_the_best_tokens_in_order(trained: tuple[MockBackend, Path]) -> None:
    backend, _ = trained
    prompt = [3, 17, 42]

    output = backend.sample("a", [_request(prompt, prompt_logprobs=True, topk_prompt_logprobs=3)])[0]

    assert output.topk_prompt_logprobs is not None and output.prompt_logprobs is not None
    assert output.topk_prompt_logprobs[0] == []
    for position in (1, 2):
        top = output.topk_prompt_logprobs[position]
        assert len(top) == 3
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][0] == prompt[position]  # the trained cycle makes the actual token the best one
        assert top[0][1] == pytest.approx(output.prompt_logprobs[position], abs=1e-5)


def test_sampler_serves_several_adapters_through_a_small_cache(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB)
    _train_cycle(backend, "cycle")
    backend.create_adapter("fresh", LoraSpec(rank=8, seed=0))
    for adapter_id in ("cycle", "fresh"):
        (tmp_path / adapter_id).mkdir()
        backend.save_weights_for_sampler(adapter_id, tmp_path / adapter_id)
    sampler = MockSampler(VOCAB, max_cached_adapters=1)

    names: list[str | None] = ["cycle", "fresh", "cycle", None]
    for name in names:
        path = None if name is None else str(tmp_path / name)
        got = sampler.sample([_request([3], adapter_path=path)])[0].sequences[0].tokens
        expected = backend.sample(name, [_request([3])])[0].sequences[0].tokens
        assert got == expected


def test_bad_sampling_requests_are_refused() -> None:
    sampler = MockSampler(VOCAB, max_length=32)

    with pytest.raises(InvalidRequest, match=r"30 tokens and max_tokens is 5, together over .* 32"):
        sampler.sample([_request([1] * 30, SamplingParams(max_tokens=5))])
    with pytest.raises(InvalidRequest, match="temperature"):
        sampler.sample([_request([1], SamplingParams(temperature=-1))])
    with pytest.raises(InvalidRequest, match="top_p"):
        sampler.sample([_request([1], SamplingParams(top_p=0))])
    with pytest.raises(InvalidRequest, match="empty"):
        sampler.sample([_request([])])
    with pytest.raises(InvalidRequest, match="outside"):
        sampler.sample([_request([VOCAB])])
    with pytest.raises(NotFound):
        sampler.sample([_request([1], adapter_path="/nonexistent/sampler_weights")])


def test_zero_max_tokens_returns_empty_sequences() -> None:
    output = MockSampler(VOCAB).sample([_request([1], SamplingParams(max_tokens=0), num_samples=2)])[0]

    assert [(s.tokens, s.stop_reason) for s in output.sequences] == [([], "length"), ([], "length")]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=1.0, seed=11),
                                    SamplingParams(max_tokens=12, temperature=0.7, top_k=5, top_p=0.9, seed=11),
                                    GREEDY],
                         ids=["temperature 1", "top_k and top_p", "greedy"])
def test_a_checkpoints_kept_rows_draw_exactly_what_the_full_computation_draws(
    trained: tuple[MockBackend, Path], params: SamplingParams
) -> None:
    backend, weights = trained
    request = _request([3, 17], params, num_samples=3, topk_sample_logprobs=2)
    sampler = MockSampler(VOCAB)

    kept = sampler.sample([replace(request, adapter_path=str(weights))])[0]
    again = sampler.sample([replace(request, adapter_path=str(weights))])[0]
    computed = backend.sample("a", [request])[0]  # the live adapter: every step computed in full

    for output in (kept, again):
        assert [s.tokens for s in output.sequences] == [s.tokens for s in computed.sequences]
        assert [s.logprobs for s in output.sequences] == [s.logprobs for s in computed.sequences]
        assert [s.topk_logprobs for s in output.sequences] == [s.topk_logprobs for s in computed.sequences]


def test_kept_rows_stay_within_their_byte_budget() -> None:
    rows = NextTokenRows(VOCAB, budget_bytes=20 * 12 * VOCAB)
    sampler = MockSampler(VOCAB)
    base = sampler._base  # the served base model the sampler draws from
    params = SamplingParams(max_tokens=1, temperature=1.0)

    for token in range(VOCAB):
        rows.draw(base, None, np.array([token]), params, np.random.default_rng(0))

    assert len(rows._rows) == 20
    assert [key[0] for key in rows._rows] == list(range(VOCAB - 20, VOCAB))  # the least recently used went first
