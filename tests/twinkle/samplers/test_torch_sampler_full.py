"""The torch sampler serving full-parameter checkpoints (whole model directories) beside the base and its adapters.

A full checkpoint here is the tiny model with two weights changed so that one chosen token wins every step
by a wide margin: column 0 of every input embedding is made large and positive, so the final hidden state's
first coordinate is positive whatever the prompt, and the chosen token's output row reads that coordinate.
Greedy sampling from it therefore repeats the chosen token, which the base model never does.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from twinkle.backends.hf.generation import generate
from twinkle.backends.transformers_backend import TransformersBackend
from twinkle.errors import InvalidRequest, NotFound
from twinkle.full_checkpoint import write_marker
from twinkle.samplers import torch_sampler
from twinkle.samplers.full_models import full_model_name
from twinkle.samplers.torch_sampler import TorchSampler
from twinkle.samplers.vllm_sampler import VLLMSampler
from twinkle.tiny_model import build_tiny_model
from twinkle.types import LoraSpec, SampleOutput, SampleRequest, SamplingParams, chunks_from_tokens

TEST_DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")
FAVOURED, OTHER_FAVOURED, THIRD_FAVOURED = 77, 88, 99  # the token each perturbed checkpoint repeats
PROMPT = [20, 21, 22]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_full_checkpoint(base_dir: Path, directory: Path, favoured: int) -> Path:
    """A full checkpoint of the base model perturbed to repeat `favoured`, sharded, with tokenizer and marker."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    embeddings, unembedding = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding) and isinstance(unembedding, torch.nn.Linear)
    with torch.no_grad():
        embeddings.weight[:, 0] = 100.0
        unembedding.weight[favoured, 0] = 50.0
    model.save_pretrained(directory, max_shard_size="100KB")
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copy(base_dir / name, directory / name)
    write_marker(directory, base_model=str(base_dir), favoured=favoured)
    return directory


@pytest.fixture(scope="module")
def full_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_full_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("full") / "step-10", FAVOURED)


@pytest.fixture
def sampler(tiny_model_dir: Path) -> TorchSampler:
    torch.set_num_threads(1)  # tiny matrices: threads only add contention on the test box
    return TorchSampler(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE)


def _request(prompt: list[int], path: Path | None, **params: object) -> SampleRequest:
    options: dict[str, object] = {"max_tokens": 8, "temperature": 0.0, "stop_at_eos": False, **params}
    num_samples = int(options.pop("num_samples", 1))  # type: ignore[call-overload]
    return SampleRequest(chunks_from_tokens(prompt), SamplingParams(**options),  # type: ignore[arg-type]
                         num_samples=num_samples, adapter_path=None if path is None else str(path))


def _tokens(output: SampleOutput) -> list[list[int]]:
    return [sequence.tokens for sequence in output.sequences]


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


def test_the_test_checkpoint_is_sharded_and_marked(full_dir: Path) -> None:
    assert (full_dir / "model.safetensors.index.json").is_file()
    assert len(list(full_dir.glob("*.safetensors"))) > 1
    assert (full_dir / "twinkle_full.json").is_file() and (full_dir / "tokenizer.json").is_file()


def test_greedy_sampling_from_a_full_checkpoint_follows_its_weights_and_base_requests_beside_it_the_base(
    sampler: TorchSampler, full_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_alone = sampler.sample([_request(PROMPT, None)])[0]
    generations: list[object] = []

    def counted(*args: object) -> list[SampleOutput]:
        generations.append(args[0])
        return generate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_sampler, "generate", counted)
    base, full, seeded_base = sampler.sample([
        _request(PROMPT, None), _request(PROMPT, full_dir), _request(PROMPT, None, temperature=1.0, seed=3)])
    monkeypatch.undo()

    assert _tokens(full) == [[FAVOURED] * 8]
    assert max(-logprob for logprob in full.sequences[0].logprobs) < 1e-3  # overwhelmingly likely
    assert _tokens(base) == _tokens(base_alone) and FAVOURED not in _tokens(base)[0]
    assert _tokens(seeded_base) == _tokens(sampler.sample([_request(PROMPT, None, temperature=1.0, seed=3)])[0])
    assert len(generations) == 2 and generations[0] is sampler.shared and generations[1] is not sampler.shared
    assert sampler.loaded_full_models == [full_model_name(full_dir)] and sampler.loaded_adapters == []


def test_a_full_checkpoints_logprobs_are_those_of_a_sampler_whose_base_is_that_checkpoint(
    sampler: TorchSampler, full_dir: Path
) -> None:
    request = _request(PROMPT * 3, full_dir, temperature=1.0, seed=5, num_samples=2, max_tokens=4)
    request.prompt_logprobs = True
    (served,) = sampler.sample([request])

    as_base = TorchSampler(str(full_dir), torch_dtype="float32", device=TEST_DEVICE)
    request.adapter_path = None
    (expected,) = as_base.sample([request])

    assert _tokens(served) == _tokens(expected)
    assert served.prompt_logprobs is not None and expected.prompt_logprobs is not None
    np.testing.assert_allclose(np.array(served.prompt_logprobs[1:], dtype=np.float64),
                               np.array(expected.prompt_logprobs[1:], dtype=np.float64), atol=1e-5)
    assert min(value for value in served.prompt_logprobs if value is not None) < -10  # not the favoured token


def test_a_full_checkpoint_rewritten_in_place_is_loaded_again(
    sampler: TorchSampler, tiny_model_dir: Path, tmp_path: Path
) -> None:
    moving = write_full_checkpoint(tiny_model_dir, tmp_path / "moving", FAVOURED)
    before = sampler.sample([_request(PROMPT, moving)])[0]
    write_full_checkpoint(tiny_model_dir, moving, OTHER_FAVOURED)

    after = sampler.sample([_request(PROMPT, moving)])[0]

    assert _tokens(before) == [[FAVOURED] * 8] and _tokens(after) == [[OTHER_FAVOURED] * 8]
    assert sampler.loaded_full_models == [full_model_name(moving)]  # the stale copy was evicted


def test_full_models_beyond_max_full_models_are_evicted_least_recently_used(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sampler = TorchSampler(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE, max_full_models=2)
    a, b, c = (write_full_checkpoint(tiny_model_dir, tmp_path / name, favoured)
               for name, favoured in (("a", FAVOURED), ("b", OTHER_FAVOURED), ("c", THIRD_FAVOURED)))

    outputs = sampler.sample([_request(PROMPT, a), _request(PROMPT, b)])
    outputs += sampler.sample([_request(PROMPT, a, max_tokens=2)])
    assert sampler.loaded_full_models == [full_model_name(b), full_model_name(a)]  # a was used last
    outputs += sampler.sample([_request(PROMPT, c)])

    assert [_tokens(output) for output in outputs] == [
        [[FAVOURED] * 8], [[OTHER_FAVOURED] * 8], [[FAVOURED] * 2], [[THIRD_FAVOURED] * 8]]
    assert sampler.loaded_full_models == [full_model_name(a), full_model_name(c)]


def test_full_checkpoints_of_another_vocabulary_or_with_weights_missing_are_refused_and_without_any_not_found(
    sampler: TorchSampler, tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = build_tiny_model(tmp_path / "other-vocab", vocab_size=640)
    write_marker(other)
    with pytest.raises(InvalidRequest, match=r"do not fit.*vocab_size 640"):
        sampler.sample([_request(PROMPT, other)])

    partial = write_full_checkpoint(tiny_model_dir, tmp_path / "partial", FAVOURED)
    shard = partial / json.loads((partial / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    weights = load_file(shard)
    del weights["lm_head.weight"]
    save_file(weights, shard, metadata={"format": "pt"})
    with pytest.raises(InvalidRequest, match=r"incomplete.*lm_head\.weight"):
        sampler.sample([_request(PROMPT, partial)])

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(other / "config.json", empty / "config.json")
    write_marker(empty)
    with pytest.raises(NotFound):
        sampler.sample([_request(PROMPT, empty)])
    assert sampler.loaded_full_models == []


def test_serve_runs_full_checkpoint_requests_beside_a_running_generation_without_stopping_it(
    sampler: TorchSampler, full_dir: Path, tmp_path: Path
) -> None:
    first = [_request(PROMPT, None, max_tokens=12), _request([5, 6, 7], None, temperature=1.0, seed=5, max_tokens=12)]
    later = [_request(PROMPT, full_dir, num_samples=2, max_tokens=6),
             _request([9, 10], None, temperature=1.0, seed=7, max_tokens=6),
             _request([9], full_dir, max_tokens=3),
             _request([9], tmp_path / "nowhere")]
    futures, calls = _serve(sampler, {0: first, 3: later})

    assert calls < 12 + 6  # one pass: the full model's requests did not wait for the running ones, nor they for it
    assert _tokens(futures[2].result(timeout=0)) == [[FAVOURED] * 6] * 2
    assert _tokens(futures[4].result(timeout=0)) == [[FAVOURED] * 3]
    assert isinstance(futures[5].exception(timeout=0), NotFound)
    for future, request in zip(futures[:2] + futures[3:4], first + later[1:2], strict=True):
        (alone,) = sampler.sample([request])
        assert _tokens(future.result(timeout=0)) == _tokens(alone)
        np.testing.assert_allclose(future.result().sequences[0].logprobs, alone.sequences[0].logprobs, atol=1e-5)


def test_serve_waits_for_a_full_model_slot_instead_of_evicting_a_running_full_model(
    sampler: TorchSampler, full_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = write_full_checkpoint(tiny_model_dir, tmp_path / "other", OTHER_FAVOURED)
    arrivals = {0: [_request(PROMPT, full_dir)], 1: [_request(PROMPT, other), _request(PROMPT, None, max_tokens=3)],
                2: [_request(PROMPT, full_dir, max_tokens=2)]}  # behind `other`: it must not keep full_dir's slot
    futures, calls = _serve(sampler, arrivals)

    assert [_tokens(future.result(timeout=0)) for future in futures] == [
        [[FAVOURED] * 8], [[OTHER_FAVOURED] * 8], _tokens(sampler.sample([arrivals[1][1]])[0]), [[FAVOURED] * 2]]
    assert calls > 8 + 8 - 1  # `other` ran after the first full request ended
    assert sampler.loaded_full_models == [full_model_name(full_dir)]  # the last one served


def test_a_sampler_sharing_a_training_backend_loads_its_own_copy_of_a_full_checkpoint(
    tiny_model_dir: Path, full_dir: Path
) -> None:
    backend = TransformersBackend(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE)
    backend.create_adapter("tenant", LoraSpec(rank=4))  # the shared model is now wrapped by PEFT
    sharing = TorchSampler.sharing(backend)
    before = sharing.sample([_request(PROMPT, None)])[0]

    full, base = sharing.sample([_request(PROMPT, full_dir), _request(PROMPT, None)])

    assert _tokens(full) == [[FAVOURED] * 8]
    assert _tokens(base) == _tokens(before)  # the backend's own weights are untouched
    assert len(backend.shared.adapters) == 1 and sharing.loaded_full_models == [full_model_name(full_dir)]


def test_a_vllm_sampler_refuses_a_full_checkpoint_naming_the_torch_sampler(
    tiny_model_dir: Path, full_dir: Path
) -> None:
    engines: list[str] = []
    sampler = VLLMSampler(str(tiny_model_dir), engine_factory=lambda model, args: engines.append(model))
    with pytest.raises(InvalidRequest, match=r"torch sampler.*model_id"):
        sampler.sample([_request(PROMPT, full_dir)])
    assert engines == [str(tiny_model_dir)]  # built, but never asked to generate
