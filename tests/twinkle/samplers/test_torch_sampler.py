from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from twinkle.backends.hf.generation import generate
from twinkle.backends.transformers_backend import TransformersBackend
from twinkle.errors import InvalidRequest, NotFound
from twinkle.samplers import torch_sampler
from twinkle.samplers.torch_sampler import TorchSampler
from twinkle.types import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    LoraSpec,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    chunks_from_tokens,
)

TEST_DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")
# Two tenants learn two different cycles of single letters, so greedy continuations tell the adapters apart
# and stop strings can name letters.
CYCLES = {"up": "abcdefghij", "down": "zyxwvutsrq"}


@dataclass
class Trained:
    backend: TransformersBackend
    paths: dict[str, Path]
    up: list[int]  # token ids of "abcdefghij"
    down: list[int]  # token ids of "zyxwvutsrq"


def _ce_datum(tokens: list[int]) -> Datum:
    return Datum(chunks_from_tokens(tokens[:-1]), {"target_tokens": np.asarray(tokens[1:], np.int64)})


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A backend with two adapters trained on different cycles, and their sampler checkpoints."""
    torch.set_num_threads(1)  # tiny matrices: threads only add contention on the test box
    backend = TransformersBackend(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE)
    cycles = {name: backend.shared.base.tokenizer.convert_tokens_to_ids(list(text)) for name, text in CYCLES.items()}
    paths = {}
    for seed, (name, cycle) in enumerate(cycles.items()):
        backend.create_adapter(name, LoraSpec(rank=8, seed=seed))
        for _ in range(20):
            backend.forward_backward(name, ForwardBackwardInput([_ce_datum(cycle * 4)]))
            backend.optim_step(name, AdamParams(learning_rate=3e-3))
        paths[name] = tmp_path_factory.mktemp("sampler") / name
        backend.save_weights_for_sampler(name, paths[name])
    return Trained(backend, paths, cycles["up"], cycles["down"])


@pytest.fixture
def sampler(tiny_model_dir: Path) -> TorchSampler:
    return TorchSampler(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE)


def _request(prompt: list[int], path: Path | None, **params: object) -> SampleRequest:
    options: dict[str, object] = {"max_tokens": 8, "temperature": 0.0, "stop_at_eos": False, **params}
    num_samples = int(options.pop("num_samples", 1))  # type: ignore[call-overload]
    return SampleRequest(
        chunks_from_tokens(prompt),
        SamplingParams(**options),  # type: ignore[arg-type]
        num_samples=num_samples,
        adapter_path=None if path is None else str(path),
    )


def _tokens(output: SampleOutput) -> list[list[int]]:
    return [sequence.tokens for sequence in output.sequences]


def test_greedy_sampling_continues_each_adapters_pattern(sampler: TorchSampler, trained: Trained) -> None:
    up, down = sampler.sample(
        [_request(trained.up[:3], trained.paths["up"]), _request(trained.down[:3], trained.paths["down"])]
    )
    assert _tokens(up) == [(trained.up * 2)[3:11]]
    assert _tokens(down) == [(trained.down * 2)[3:11]]
    assert up.sequences[0].stop_reason == "length"


def test_prompt_logprobs_equal_the_trainers_forward_logprobs(sampler: TorchSampler, trained: Trained) -> None:
    prompt = (trained.up * 4)[3:25]
    request = _request(prompt, trained.paths["up"], max_tokens=1)
    request.prompt_logprobs = True

    (output,) = sampler.sample([request])
    forward = trained.backend.forward("up", ForwardBackwardInput([_ce_datum(prompt)])).loss_fn_outputs[0]["logprobs"]

    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    np.testing.assert_allclose(np.array(output.prompt_logprobs[1:], dtype=np.float64), forward, atol=1e-4)


def test_sampled_logprobs_are_the_raw_models_logprobs_of_the_sampled_tokens(
    sampler: TorchSampler, trained: Trained
) -> None:
    prompt = trained.up[:3]
    (output,) = sampler.sample([_request(prompt, trained.paths["up"], temperature=0.7, top_k=20, seed=3, max_tokens=6)])
    sequence = output.sequences[0]

    tokens = prompt + sequence.tokens
    forward = trained.backend.forward("up", ForwardBackwardInput([_ce_datum(tokens)])).loss_fn_outputs[0]["logprobs"]

    np.testing.assert_allclose(sequence.logprobs, forward[len(prompt) - 1 :], atol=1e-4)


def _forward_logprobs(trained: Trained, adapter: str, tokens: list[int]) -> np.ndarray:
    """What the trainer's `forward` (loss cross_entropy) reports for `tokens[1:]` after their prefixes."""
    return trained.backend.forward(adapter, ForwardBackwardInput([_ce_datum(tokens)])).loss_fn_outputs[0]["logprobs"]


def _gap(trained: Trained, adapter: str, request: SampleRequest, output: SampleOutput) -> float:
    """The largest difference between the sampler's logprobs (sampled and prompt) and the trainer's."""
    prompt = [int(token) for token in request.prompt[0].tokens]  # type: ignore[union-attr]
    gaps = [0.0]
    for sequence in output.sequences:
        forward = _forward_logprobs(trained, adapter, prompt + sequence.tokens)
        gaps.append(float(np.abs(np.asarray(sequence.logprobs) - forward[len(prompt) - 1 :]).max(initial=0.0)))
    if output.prompt_logprobs is not None and len(prompt) > 1:
        forward = _forward_logprobs(trained, adapter, prompt)
        gaps.append(float(np.abs(np.asarray(output.prompt_logprobs[1:], dtype=np.float64) - forward).max()))
    return max(gaps)


# Prompts of different lengths (left padding), sampling parameters that filter the distribution, both adapters.
MIXED = [("up", 3, {"temperature": 1.0}), ("down", 7, {"temperature": 0.7, "top_k": 5}),
         ("up", 1, {"temperature": 1.3, "top_p": 0.8}), ("down", 12, {"temperature": 0.0}),
         ("up", 5, {"temperature": 0.5, "top_k": 50, "top_p": 0.95})]


def _mixed(trained: Trained) -> list[tuple[str, SampleRequest]]:
    cycles = {"up": trained.up * 3, "down": trained.down * 3}
    requests = []
    for seed, (adapter, length, params) in enumerate(MIXED):
        request = _request(cycles[adapter][seed : seed + length], trained.paths[adapter], seed=seed, max_tokens=7,
                           num_samples=2, **params)
        request.prompt_logprobs = True
        requests.append((adapter, request))
    return requests


def test_logprobs_of_a_mixed_adapter_batch_equal_the_trainers_within_1e_4(
    sampler: TorchSampler, trained: Trained
) -> None:
    jobs = _mixed(trained)
    outputs = sampler.sample([request for _, request in jobs])
    gaps = [_gap(trained, adapter, request, output) for (adapter, request), output in zip(jobs, outputs, strict=True)]
    assert max(gaps) < 1e-4, gaps


def test_logprobs_of_requests_joining_a_running_generation_equal_the_trainers_within_1e_4(
    sampler: TorchSampler, trained: Trained
) -> None:
    jobs = _mixed(trained)
    requests = [request for _, request in jobs]
    futures, _ = _serve(sampler, {0: requests[:2], 2: requests[2:4], 4: requests[4:]})  # two joins
    gaps = [_gap(trained, adapter, request, future.result(timeout=0))
            for (adapter, request), future in zip(jobs, futures, strict=True)]
    assert max(gaps) < 1e-4, gaps


def test_the_model_pools_own_sampling_reports_the_logprobs_its_forward_computes(trained: Trained) -> None:
    for adapter, request in _mixed(trained):
        request.adapter_path = None  # the model pool samples the adapter it trains, by id
        (output,) = trained.backend.sample(adapter, [request])
        assert _gap(trained, adapter, request, output) < 1e-4


def test_a_seeded_request_draws_the_same_tokens_alone_in_a_mixed_batch_and_joining_one(
    sampler: TorchSampler, trained: Trained
) -> None:
    seeded = _request([7, 8, 9], trained.paths["up"], temperature=1.0, seed=42, num_samples=3, max_tokens=10)
    others = [request for _, request in _mixed(trained)]
    alone = sampler.sample([seeded])[0]
    sampler.sample(others[:2])  # both adapters loaded (PEFT initialises a new adapter from the global RNG)
    global_state = torch.get_rng_state()

    in_batch = sampler.sample([others[0], seeded, *others[1:]])[1]
    futures, _ = _serve(sampler, {0: others[:3], 3: [seeded]})

    assert _tokens(in_batch) == _tokens(alone) == _tokens(futures[3].result(timeout=0))
    assert torch.equal(torch.get_rng_state(), global_state)  # per-request generators: the global one is untouched
    unseeded = [_tokens(sampler.sample([_request([7, 8, 9], trained.paths["up"], temperature=1.0,
                                                 num_samples=3, max_tokens=10)])[0]) for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_each_sampled_token_comes_with_the_raw_models_top_k(sampler: TorchSampler, trained: Trained) -> None:
    prompt = trained.up[:3]
    request = _request(prompt, trained.paths["up"], temperature=0.8, top_k=3, seed=1, max_tokens=6)
    request.topk_sample_logprobs = 4
    (output,) = sampler.sample([request, _request(trained.down[:2], trained.paths["down"])])[:1]
    sequence = output.sequences[0]

    rescored = _request(prompt + sequence.tokens, trained.paths["up"], max_tokens=0)
    rescored.topk_prompt_logprobs = 4
    (expected,) = sampler.sample([rescored])
    assert sequence.topk_logprobs is not None and expected.topk_prompt_logprobs is not None
    assert len(sequence.topk_logprobs) == len(sequence.tokens)
    for position, (token, logprob, top) in enumerate(zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs,
                                                         strict=True)):
        assert len(top) == 4 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert dict(top).get(token, logprob) == pytest.approx(logprob, abs=1e-6)
        want = expected.topk_prompt_logprobs[len(prompt) + position]
        assert [t for t, _ in top] == [t for t, _ in want]
        np.testing.assert_allclose([lp for _, lp in top], [lp for _, lp in want], atol=1e-4)
    assert sampler.sample([_request(prompt, None)])[0].sequences[0].topk_logprobs is None


def test_a_mixed_adapter_batch_matches_one_request_at_a_time(
    sampler: TorchSampler, trained: Trained, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = trained.paths
    requests = [
        _request(trained.up[:2], paths["up"]),
        _request(trained.down[:4], paths["down"], temperature=1.0, seed=11, num_samples=3),
        _request([5, 6, 7], None, temperature=0.8, top_p=0.9, seed=2),
        _request(trained.up[4:7], paths["up"], temperature=1.0, seed=4, num_samples=2, max_tokens=3),
    ]

    generations = []

    def counted(*args: object) -> list[SampleOutput]:
        generations.append(args)
        return generate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_sampler, "generate", counted)
    together = sampler.sample(requests)
    assert len(generations) == 1  # two adapters and the base model in one batched generation
    alone = [sampler.sample([request])[0] for request in requests]

    for batched, single in zip(together, alone, strict=True):
        assert _tokens(batched) == _tokens(single)
        for a, b in zip(batched.sequences, single.sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert [len(output.sequences) for output in together] == [1, 3, 1, 2]


def test_the_same_seed_gives_the_same_samples(sampler: TorchSampler, trained: Trained) -> None:
    path = trained.paths["up"]
    request = _request([7, 8, 9], path, temperature=1.0, seed=123, num_samples=4, max_tokens=10)
    first, second = sampler.sample([request]), sampler.sample([request])
    other = sampler.sample([_request([7, 8, 9], path, temperature=1.0, seed=124, num_samples=4, max_tokens=10)])
    assert _tokens(first[0]) == _tokens(second[0])
    assert _tokens(first[0]) != _tokens(other[0])
    assert len(set(map(tuple, _tokens(first[0])))) > 1  # the samples of one request differ from each other


def test_top_k_of_one_and_a_tiny_top_p_are_greedy(sampler: TorchSampler) -> None:
    greedy = sampler.sample([_request([20, 21, 22], None)])[0]
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        filtered = sampler.sample([_request([20, 21, 22], None, temperature=1.0, seed=9, **params)])[0]
        assert _tokens(filtered) == _tokens(greedy)


def test_generation_stops_at_stop_tokens_strings_and_length(sampler: TorchSampler, trained: Trained) -> None:
    a, b, c, d, e, f = trained.up[:6]
    path = trained.paths["up"]
    by_token, by_string, by_length = sampler.sample(
        [
            _request([a, b], path, stop_token_ids=(e,)),
            _request([a, b], path, stop_strings=("xyz", "def")),
            _request([a, b], path, max_tokens=2),
        ]
    )
    assert by_token.sequences[0].tokens == [c, d, e] and by_token.sequences[0].stop_reason == "stop"
    assert by_string.sequences[0].tokens == [c, d, e, f] and by_string.sequences[0].stop_reason == "stop"
    assert by_length.sequences[0].tokens == [c, d] and by_length.sequences[0].stop_reason == "length"


def test_eos_stops_generation_only_when_stop_at_eos_is_set(sampler: TorchSampler, trained: Trained) -> None:
    a, b, c, d, e = trained.up[:5]
    path = trained.paths["up"]
    # The tiny model never favours its real EOS, so declare a letter of the learned cycle to be EOS.
    sampler.shared.base.eos_token_ids = frozenset({e})
    at_eos, through_eos = sampler.sample(
        [_request([a, b], path, stop_at_eos=True), _request([a, b], path, stop_at_eos=False)]
    )
    assert at_eos.sequences[0].tokens == [c, d, e] and at_eos.sequences[0].stop_reason == "stop"
    assert len(through_eos.sequences[0].tokens) == 8 and through_eos.sequences[0].stop_reason == "length"


def test_top_k_prompt_logprobs_are_sorted_and_start_empty(sampler: TorchSampler) -> None:
    request = _request([30, 31, 32, 33], None, max_tokens=0)
    request.prompt_logprobs = True
    request.topk_prompt_logprobs = 3

    (output,) = sampler.sample([request])

    assert output.topk_prompt_logprobs is not None and output.prompt_logprobs is not None
    assert output.topk_prompt_logprobs[0] == [] and len(output.topk_prompt_logprobs) == 4
    for position, top in enumerate(output.topk_prompt_logprobs[1:], start=1):
        values = [value for _, value in top]
        assert len(top) == 3 and values == sorted(values, reverse=True)
        assert values[0] >= output.prompt_logprobs[position]  # type: ignore[operator]
    assert output.sequences[0].tokens == [] and output.sequences[0].stop_reason == "length"


def test_adapters_beyond_max_loras_are_evicted_least_recently_used(
    tiny_model_dir: Path, trained: Trained, tmp_path: Path
) -> None:
    paths, up, down = trained.paths, trained.up, trained.down
    third = tmp_path / "third"
    shutil.copytree(paths["up"], third)
    sampler = TorchSampler(str(tiny_model_dir), max_loras=2, torch_dtype="float32", device=TEST_DEVICE)

    outputs = sampler.sample(
        [_request(up[:2], paths["up"]), _request(down[:2], paths["down"]), _request(up[:2], third)]
    )

    assert _tokens(outputs[0]) == _tokens(outputs[2]) == [up[2:10]]
    assert _tokens(outputs[1]) == [down[2:10]]
    assert len(sampler.loaded_adapters) == 2
    assert sampler.shared.adapters == sampler.loaded_adapters


def test_missing_checkpoints_and_bad_parameters_are_user_errors(sampler: TorchSampler, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        sampler.sample([_request([1, 2], tmp_path / "nothing")])
    with pytest.raises(InvalidRequest, match="top_p"):
        sampler.sample([_request([1, 2], None, top_p=0.0)])
    with pytest.raises(InvalidRequest, match="empty prompt"):
        sampler.sample([_request([], None)])


def test_a_checkpoint_rewritten_in_place_is_loaded_again(
    sampler: TorchSampler, trained: Trained, tmp_path: Path
) -> None:
    moving = tmp_path / "moving"
    shutil.copytree(trained.paths["up"], moving)
    before = sampler.sample([_request(trained.down[:2], moving)])[0]
    shutil.rmtree(moving)
    shutil.copytree(trained.paths["down"], moving)

    after = sampler.sample([_request(trained.down[:2], moving)])[0]

    assert _tokens(after) == [trained.down[2:10]] != _tokens(before)


def test_sampler_weights_of_another_shape_are_a_user_error(
    sampler: TorchSampler, trained: Trained, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(trained.paths["up"], broken)
    weights = load_file(broken / "adapter_model.safetensors")
    weights = {key: torch.zeros(value.shape[0] + 1, *value.shape[1:]) for key, value in weights.items()}
    save_file(weights, broken / "adapter_model.safetensors")

    with pytest.raises(InvalidRequest, match="do not fit"):
        sampler.sample([_request([1, 2], broken)])
    assert sampler.loaded_adapters == [] and sampler.shared.adapters == []


def _serve(sampler: TorchSampler, arrivals: dict[int, list[SampleRequest]]) -> tuple[list[Future[SampleOutput]], int]:
    """Run `serve`, handing out `arrivals[k]` at its k-th call of take; returns the futures and the calls."""
    futures: list[Future[SampleOutput]] = []
    calls = 0

    def take() -> list[tuple[SampleRequest, Future[SampleOutput]]]:
        nonlocal calls
        jobs = [(request, Future[SampleOutput]()) for request in arrivals.get(calls, [])]
        futures.extend(future for _, future in jobs)
        calls += 1
        return jobs

    sampler.serve(take)
    return futures, calls


def test_requests_that_arrive_mid_generation_join_it_and_get_what_they_get_alone(
    sampler: TorchSampler, trained: Trained
) -> None:
    paths = trained.paths
    first = [_request(trained.up[:2], paths["up"], max_tokens=12),
             _request([5, 6, 7], None, temperature=1.0, seed=5, max_tokens=12)]
    later = [_request(trained.down[:6], paths["down"], temperature=1.0, seed=11, num_samples=2, max_tokens=6),
             _request(trained.up[3:4], paths["up"], max_tokens=3)]  # a shorter prompt than the running rows
    futures, calls = _serve(sampler, {0: first, 4: later})  # joins after 3 decode steps

    assert calls < 12 + 6  # one generation: the later requests did not wait for the first ones to end
    alone = [sampler.sample([request])[0] for request in first + later]
    for future, single in zip(futures, alone, strict=True):
        joined = future.result(timeout=0)
        assert _tokens(joined) == _tokens(single)
        for a, b in zip(joined.sequences, single.sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert _tokens(futures[0].result()) == [(trained.up * 3)[2:14]]


def test_a_bad_request_joining_a_generation_fails_alone(sampler: TorchSampler, trained: Trained) -> None:
    good = _request(trained.up[:2], trained.paths["up"])
    out_of_vocab = _request([10**6], None)
    missing = _request([5], trained.paths["up"].parent / "nowhere")
    futures, _ = _serve(sampler, {0: [good], 2: [out_of_vocab, missing, _request(trained.down[:3], None)]})

    assert _tokens(futures[0].result(timeout=0)) == [(trained.up * 2)[2:10]]
    assert isinstance(futures[1].exception(timeout=0), InvalidRequest)
    assert isinstance(futures[2].exception(timeout=0), NotFound)
    assert len(futures[3].result(timeout=0).sequences[0].tokens) == 8


def test_requests_beyond_the_adapter_slots_wait_for_a_slot_instead_of_evicting_a_running_adapter(
    tiny_model_dir: Path, trained: Trained
) -> None:
    one_slot = TorchSampler(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE, max_loras=1)
    up, down = _request(trained.up[:2], trained.paths["up"]), _request(trained.down[:2], trained.paths["down"])
    futures, calls = _serve(one_slot, {0: [up], 1: [down]})

    assert calls > 8 + 8 - 1  # down ran after up, in the same serve call
    assert _tokens(futures[0].result(timeout=0)) == [(trained.up * 2)[2:10]]
    assert _tokens(futures[1].result(timeout=0)) == [(trained.down * 2)[2:10]]


def test_a_job_asking_for_progress_sees_its_tokens_grow_before_its_result(sampler: TorchSampler) -> None:
    seen: list[list[list[int]]] = []
    future = Future[SampleOutput]()
    future.progress = lambda rows: seen.append([list(row) for row in rows])  # type: ignore[attr-defined]
    taken = False

    def take() -> list[tuple[SampleRequest, Future[SampleOutput]]]:
        nonlocal taken
        jobs = [] if taken else [(_request([5, 6, 7], None, max_tokens=6, num_samples=2, temperature=1.0, seed=3),
                                  future)]
        taken = True
        return jobs

    sampler.serve(take)
    final = _tokens(future.result(timeout=0))
    assert [len(rows[0]) for rows in seen] == [1, 2, 3, 4, 5]  # after each step but the last, which resolves it
    assert all(row == full[: len(row)] for rows in seen for row, full in zip(rows, final, strict=True))
