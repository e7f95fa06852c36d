"""The vllm sampler against a fake vLLM that implements exactly the API the sampler uses.

The fake is installed as the `vllm` package (and `vllm.lora.request`) and mirrors vLLM's names: `LLM(model,
**engine_args)`, `LLM.generate(prompts, sampling_params, *, use_tqdm, lora_request)` over `TokensPrompt`
dicts, `LLM.llm_engine.remove_lora(id)`, `SamplingParams` with vLLM's field names and defaults,
`LoRARequest(lora_name, lora_int_id, lora_path)`, and `RequestOutput` / `CompletionOutput` / `Logprob`
results. Its "model" is a rule: after token t, under LoRA id L, the token of rank r is (t + r + L) % vocab
with logprob -0.5 - 0.25·r, so every value the sampler reports can be checked by hand.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from twinkle.errors import BackendFailure, InvalidRequest, NotFound
from twinkle.samplers.vllm_sampler import VLLMSampler
from twinkle.types import ImageChunk, SampleRequest, SamplingParams, TextChunk, chunks_from_tokens

REPO = Path(__file__).resolve().parents[3]
VOCAB = 512
EOS = 2  # the tiny model's <|im_end|>


# The fake vLLM


@dataclass
class FakeSamplingParams:
    """vllm.SamplingParams: the fields the sampler sets, vLLM's defaults; unknown names raise TypeError."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass
class FakeLoRARequest:
    """vllm.lora.request.LoRARequest."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True


def rank_logprob(rank: int) -> float:
    return -0.5 - 0.25 * rank


def ranked_token(previous: int, rank: int, lora_id: int) -> int:
    return (previous + rank + lora_id) % VOCAB


@dataclass
class FakeEngineCore:
    """LLM.llm_engine: the LoRA registry calls."""

    removed: list[int] = field(default_factory=list)
    loaded: dict[int, str] = field(default_factory=dict)

    def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.loaded.pop(lora_id, None) is not None


class FakeLLM:
    """vllm.LLM with the toy model above."""

    instances: list[FakeLLM] = []

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.model = model
        self.engine_args = engine_args
        self.llm_engine = FakeEngineCore()
        self.calls: list[dict[str, Any]] = []
        self.gate: threading.Event | None = None  # when set, generate waits for it (to queue up callers)
        self.entered = threading.Event()
        self.finish_reason_override: str | None = None
        FakeLLM.instances.append(self)

    def generate(
        self,
        prompts: list[dict[str, list[int]]],
        sampling_params: FakeSamplingParams | list[FakeSamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: FakeLoRARequest | list[FakeLoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or FakeSamplingParams()] * len(prompts)
        )
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        assert len(params) == len(prompts) == len(loras)
        if any(loras) and not self.engine_args.get("enable_lora"):
            raise ValueError("LoRA is not enabled!")
        for lora in loras:
            if lora is not None:
                assert (Path(lora.lora_path) / "adapter_config.json").is_file()
                self.llm_engine.loaded[lora.lora_int_id] = lora.lora_path
        self.calls.append({"prompts": prompts, "params": params, "loras": loras, "use_tqdm": use_tqdm})
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        outputs = [
            self._complete(str(index), prompt["prompt_token_ids"], param, lora.lora_int_id if lora else 0)
            for index, (prompt, param, lora) in enumerate(zip(prompts, params, loras, strict=True))
        ]
        self.calls[-1]["outputs"] = outputs
        return outputs

    def _complete(
        self, request_id: str, prompt: list[int], params: FakeSamplingParams, lora: int
    ) -> RequestOutput:
        rng = random.Random(params.seed)
        completions = [self._sample(index, prompt, params, lora, rng) for index in range(params.n)]
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None]
            for previous, token in itertools.pairwise(prompt):
                entry = self._alternatives(previous, lora, params.prompt_logprobs)
                rank = (token - previous - lora) % VOCAB or VOCAB
                entry.setdefault(token, Logprob(rank_logprob(rank), rank))
                prompt_logprobs.append(entry)
        return RequestOutput(request_id, None, prompt, prompt_logprobs, completions)

    def _sample(
        self, index: int, prompt: list[int], params: FakeSamplingParams, lora: int, rng: random.Random
    ) -> CompletionOutput:
        tokens: list[int] = []
        logprobs: list[dict[int, Logprob]] = []
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        reason, stop_reason = "length", None
        previous = prompt[-1]
        limit = min(params.max_tokens or 16, self.engine_args["max_model_len"] - len(prompt))
        while len(tokens) < limit:
            rank = 1 if params.temperature == 0 else rng.choice([1, 1, 2, 3])
            token = ranked_token(previous, rank, lora)
            tokens.append(token)
            if params.logprobs is not None:
                entry = self._alternatives(previous, lora, params.logprobs)
                entry.setdefault(token, Logprob(rank_logprob(rank), rank))
                logprobs.append(entry)
            previous = token
            text = "".join(f"<{t}>" for t in tokens)
            if token == EOS and not params.ignore_eos:
                reason = "stop"
                break
            if token in (params.stop_token_ids or []):
                reason, stop_reason = "stop", token
                break
            if any(stop in text for stop in stops):
                reason, stop_reason = "stop", next(stop for stop in stops if stop in text)
                break
        return CompletionOutput(
            index,
            "",
            tokens,
            None,
            logprobs if params.logprobs is not None else None,
            self.finish_reason_override or reason,
            stop_reason,
        )

    @staticmethod
    def _alternatives(previous: int, lora: int, k: int) -> dict[int, Logprob]:
        return {
            ranked_token(previous, rank, lora): Logprob(rank_logprob(rank), rank) for rank in range(1, k + 1)
        }


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeLLM]]:
    """Install the fake as the `vllm` package for the duration of a test."""
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM  # type: ignore[attr-defined]
    vllm.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest  # type: ignore[attr-defined]
    for name, module in (("vllm", vllm), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.instances = []
    yield FakeLLM


@pytest.fixture
def sampler(fake_vllm: type[FakeLLM], tiny_model_dir: Path) -> VLLMSampler:
    return VLLMSampler(
        str(tiny_model_dir), engine_args={"max_model_len": 64, "gpu_memory_utilization": 0.5}, max_loras=2
    )


def engine(sampler: VLLMSampler) -> FakeLLM:
    assert isinstance(sampler.engine, FakeLLM)
    return sampler.engine


def adapter(directory: Path, rank: int = 8) -> str:
    """A sampler checkpoint directory as save_weights_for_sampler leaves it (contents do not matter here)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 32}))
    (directory / "adapter_model.safetensors").write_bytes(b"weights")
    return str(directory)


def request(prompt: list[int], **params: Any) -> SampleRequest:
    options = {
        key: params.pop(key)
        for key in ("num_samples", "prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "adapter_path")
        if key in params
    }
    return SampleRequest(chunks_from_tokens(prompt), SamplingParams(**params), **options)


# The engine


def test_the_engine_is_built_from_engine_args_over_the_local_model(
    sampler: VLLMSampler, tiny_model_dir: Path
) -> None:
    built = engine(sampler)
    assert built.model == str(tiny_model_dir)
    assert built.engine_args == {
        "max_model_len": 64,
        "gpu_memory_utilization": 0.5,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 32,
    }
    assert (sampler.info.vocab_size, sampler.info.max_context_length, sampler.info.eos_token_id) == (
        VOCAB,
        64,
        EOS,
    )


def test_explicit_engine_args_win_and_an_engine_factory_gets_them(
    fake_vllm: type[FakeLLM], tiny_model_dir: Path
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def factory(model: str, args: dict[str, Any]) -> FakeLLM:
        seen.append((model, args))
        return FakeLLM(model, **args)

    args = {
        "enable_lora": False,
        "max_loras": 8,
        "logprobs_mode": "processed_logprobs",
        "tensor_parallel_size": 2,
    }
    sampler = VLLMSampler(str(tiny_model_dir), engine_args=args, max_loras=3, engine_factory=factory)
    assert seen == [(str(tiny_model_dir), {**args, "max_lora_rank": 32, "max_model_len": 2048})]
    assert sampler.max_loras == 3


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
def test_logit_modes_are_refused_because_samplers_return_logprobs(
    fake_vllm: type[FakeLLM], tiny_model_dir: Path, mode: str
) -> None:
    with pytest.raises(InvalidRequest, match=f"logprobs_mode '{mode}' reports logits"):
        VLLMSampler(str(tiny_model_dir), engine_args={"logprobs_mode": mode})


# Requests to the engine


def test_a_request_becomes_vllm_sampling_params(sampler: VLLMSampler) -> None:
    sampler.sample(
        [
            request(
                [10, 11, 12],
                max_tokens=5,
                temperature=0.7,
                top_p=0.9,
                top_k=20,
                seed=4,
                stop_token_ids=(99,),
                stop_strings=("<50>",),
                num_samples=3,
                topk_prompt_logprobs=2,
            ),
            request([10, 11], stop_at_eos=False, prompt_logprobs=True),
        ]
    )
    (call,) = engine(sampler).calls
    assert call["prompts"] == [{"prompt_token_ids": [10, 11, 12]}, {"prompt_token_ids": [10, 11]}]
    assert call["use_tqdm"] is False and call["loras"] == [None, None]
    assert call["params"] == [
        FakeSamplingParams(
            n=3,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=4,
            stop=["<50>"],
            stop_token_ids=[99],
            ignore_eos=False,
            max_tokens=5,
            logprobs=0,
            prompt_logprobs=2,
            detokenize=True,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        ),
        FakeSamplingParams(
            n=1,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            seed=None,
            stop=None,
            stop_token_ids=None,
            ignore_eos=True,
            max_tokens=16,
            logprobs=0,
            prompt_logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        ),
    ]


def test_a_request_for_no_tokens_returns_empty_sequences(sampler: VLLMSampler) -> None:
    (output,) = sampler.sample([request([10, 11], max_tokens=0, num_samples=2, prompt_logprobs=True)])
    assert engine(sampler).calls[0]["params"][0].max_tokens == 1  # vLLM generates at least one token
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in output.sequences] == [([], [], "length")] * 2
    assert output.prompt_logprobs == [None, rank_logprob((11 - 10) % VOCAB)]


# Responses from the engine


def test_sampled_tokens_come_back_with_their_logprobs(sampler: VLLMSampler) -> None:
    (output,) = sampler.sample([request([10], max_tokens=4, temperature=0.0, num_samples=2)])
    assert [sequence.tokens for sequence in output.sequences] == [[11, 12, 13, 14]] * 2
    assert output.sequences[0].logprobs == [rank_logprob(1)] * 4
    assert output.sequences[0].stop_reason == "length"
    assert output.prompt_logprobs is None and output.topk_prompt_logprobs is None


def test_seeded_sampling_returns_the_engines_draws_token_for_token(sampler: VLLMSampler) -> None:
    (output,) = sampler.sample([request([10], max_tokens=8, seed=3)])
    (completion,) = engine(sampler).calls[0]["outputs"][0].outputs
    assert output.sequences[0].tokens == completion.token_ids
    assert output.sequences[0].logprobs == [
        entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    assert len(set(output.sequences[0].logprobs)) > 1  # the draws hit more than one rank


@pytest.mark.parametrize(
    ("params", "tokens"),
    [
        ({"stop_token_ids": (13,)}, [11, 12, 13]),  # a stop token ends the sequence and is kept
        ({"stop_strings": ("<12>",)}, [11, 12]),  # so does the token completing a stop string
        ({}, [1, 2]),  # EOS (2) by default
        ({"stop_at_eos": False, "max_tokens": 4}, [1, 2, 3, 4]),  # unless stop_at_eos is off
    ],
)
def test_stops_end_a_sequence_with_stop_reason_stop(
    sampler: VLLMSampler, params: dict[str, Any], tokens: list[int]
) -> None:
    prompt = [10] if tokens[0] == 11 else [0]
    (output,) = sampler.sample([request(prompt, temperature=0.0, **{"max_tokens": 8, **params})])
    assert output.sequences[0].tokens == tokens
    assert output.sequences[0].stop_reason == ("length" if params.get("stop_at_eos") is False else "stop")


def test_prompt_logprobs_start_with_none_and_top_k_lists_the_k_most_likely_first(
    sampler: VLLMSampler,
) -> None:
    prompt = [10, 11, 20, 21]
    (output,) = sampler.sample([request(prompt, max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=2)])
    assert output.prompt_logprobs == [None, rank_logprob(1), rank_logprob(9), rank_logprob(1)]
    assert output.topk_prompt_logprobs == [
        [],
        [(11, rank_logprob(1)), (12, rank_logprob(2))],
        [(12, rank_logprob(1)), (13, rank_logprob(2))],  # token 20 (rank 9) is not among the top 2
        [(21, rank_logprob(1)), (22, rank_logprob(2))],
    ]


def test_each_sampled_token_comes_with_the_engines_top_k_most_likely_first(sampler: VLLMSampler) -> None:
    (output,) = sampler.sample([request([10], max_tokens=6, seed=3, topk_sample_logprobs=2)])
    (completion,) = engine(sampler).calls[0]["outputs"][0].outputs
    assert engine(sampler).calls[0]["params"][0].logprobs == 2
    sequence = output.sequences[0]
    assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens)
    for previous, top in zip([10, *sequence.tokens], sequence.topk_logprobs, strict=False):
        # the engine's entry also holds the sampled token when it ranks below 2; it is left out
        assert top == [(ranked_token(previous, 1, 0), rank_logprob(1)), (ranked_token(previous, 2, 0), rank_logprob(2))]
    assert completion.logprobs is not None and any(len(entry) == 3 for entry in completion.logprobs)
    assert sampler.sample([request([10], max_tokens=2)])[0].sequences[0].topk_logprobs is None


def test_an_aborted_completion_is_a_backend_failure(sampler: VLLMSampler) -> None:
    engine(sampler).finish_reason_override = "abort"
    with pytest.raises(BackendFailure, match="finish_reason 'abort'"):
        sampler.sample([request([10])])


def test_invalid_requests_are_refused_before_the_engine_sees_them(sampler: VLLMSampler) -> None:
    bad = [
        SampleRequest([TextChunk(chunks_from_tokens([1])[0].tokens), ImageChunk(b"png")]),
        request([], max_tokens=2),
        request([VOCAB]),
        request([1] * 64),
        request([1], num_samples=0),
        request([1], top_p=0.0),
        request([1], topk_prompt_logprobs=21),
        request([1], topk_sample_logprobs=21),
    ]
    with pytest.raises(InvalidRequest) as error:
        sampler.sample(bad)
    message = error.value.message
    for fragment in (
        "request 0 holds images",
        "request 1 has an empty prompt",
        "request 2 has token ids outside",
        "request 3 has a 64-token prompt",
        "request 4 asks for 0 samples",
        "request 6 asks for 21 top prompt logprobs, over this pool's engine_args.max_logprobs 20",
        "request 5 has top_p 0.0",
        "request 7 asks for 21 top sampled logprobs, over this pool's engine_args.max_logprobs 20",
    ):
        assert fragment in message
    assert engine(sampler).calls == []


# LoRA adapters


def test_adapters_become_lora_requests_with_stable_ids(sampler: VLLMSampler, tmp_path: Path) -> None:
    first, second = adapter(tmp_path / "first"), adapter(tmp_path / "second")
    sampler.sample([request([10], adapter_path=first), request([10]), request([10], adapter_path=second)])
    sampler.sample([request([10], adapter_path=first)])
    calls = engine(sampler).calls
    assert calls[0]["loras"][1] is None
    one, two = calls[0]["loras"][0], calls[0]["loras"][2]
    assert (one.lora_int_id, one.lora_path, two.lora_int_id) == (1, str(Path(first).resolve()), 2)
    assert calls[1]["loras"][0] == one  # same checkpoint, same id and name: vLLM keeps it cached


def test_each_adapter_changes_what_is_sampled(sampler: VLLMSampler, tmp_path: Path) -> None:
    outputs = sampler.sample(
        [
            request([10], max_tokens=2, temperature=0.0),
            request([10], max_tokens=2, temperature=0.0, adapter_path=adapter(tmp_path / "a")),
        ]
    )
    assert [output.sequences[0].tokens for output in outputs] == [
        [11, 12],
        [12, 14],
    ]  # LoRA id 1 shifts by one


def test_a_rewritten_checkpoint_gets_a_new_id_so_it_is_loaded_again(
    sampler: VLLMSampler, tmp_path: Path
) -> None:
    path = adapter(tmp_path / "live")
    sampler.sample([request([10], adapter_path=path)])
    (Path(path) / "adapter_model.safetensors").write_bytes(b"new weights, longer")
    sampler.sample([request([10], adapter_path=path)])
    ids = [call["loras"][0].lora_int_id for call in engine(sampler).calls]
    assert ids == [1, 2]


def test_the_least_recently_used_adapter_beyond_max_loras_is_removed_from_the_engine(
    sampler: VLLMSampler, tmp_path: Path
) -> None:
    a, b, c = (adapter(tmp_path / name) for name in "abc")
    for path in (a, b, a, c):  # a is used again after b, so b is the least recently used when c arrives
        sampler.sample([request([10], adapter_path=path)])
    assert engine(sampler).llm_engine.removed == [2]
    assert sampler.loaded_adapters == [1, 3]


def test_adapters_of_one_batch_are_not_evicted_for_each_other(sampler: VLLMSampler, tmp_path: Path) -> None:
    paths = [adapter(tmp_path / name) for name in "abc"]
    sampler.sample([request([10], adapter_path=path) for path in paths])  # three adapters, max_loras 2
    assert engine(sampler).llm_engine.removed == []
    assert [lora.lora_int_id for lora in engine(sampler).calls[0]["loras"]] == [1, 2, 3]
    sampler.sample([request([10])])
    sampler.sample([request([10], adapter_path=adapter(tmp_path / "d"))])
    assert engine(sampler).llm_engine.removed == [1, 2]


def test_missing_checkpoints_and_too_large_ranks_are_refused(sampler: VLLMSampler, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="Sampler weights gone were not found"):
        sampler.sample([request([10], adapter_path=str(tmp_path / "gone"))])
    with pytest.raises(InvalidRequest, match="LoRA rank 64, over this pool's max_lora_rank 32"):
        sampler.sample([request([10], adapter_path=adapter(tmp_path / "big", rank=64))])
    assert engine(sampler).calls == []


def test_a_base_model_only_pool_refuses_adapters(
    fake_vllm: type[FakeLLM], tiny_model_dir: Path, tmp_path: Path
) -> None:
    sampler = VLLMSampler(str(tiny_model_dir), engine_args={"enable_lora": False})
    with pytest.raises(InvalidRequest, match="enable_lora is false"):
        sampler.sample([request([10], adapter_path=adapter(tmp_path / "a"))])
    assert sampler.sample([request([10], max_tokens=1, temperature=0.0)])[0].sequences[0].tokens == [11]


# Batching across callers


def test_concurrent_callers_are_served_together_by_one_generate(sampler: VLLMSampler, tmp_path: Path) -> None:
    fake = engine(sampler)
    fake.gate = threading.Event()
    results: dict[str, Any] = {}

    def call(name: str, prompt: list[int], path: str | None = None) -> None:
        results[name] = sampler.sample([request(prompt, max_tokens=1, temperature=0.0, adapter_path=path)])

    first = threading.Thread(target=call, args=("first", [10]))
    first.start()
    assert fake.entered.wait(10)  # the engine is busy with the first caller
    later = [
        threading.Thread(target=call, args=("second", [20])),
        threading.Thread(target=call, args=("third", [30], adapter(tmp_path / "a"))),
    ]
    for thread in later:
        thread.start()
    while len(sampler._waiting) < 2:  # both queue up behind the running generate
        threading.Event().wait(0.01)
    fake.gate.set()
    for thread in (first, *later):
        thread.join(10)
    assert [len(call["prompts"]) for call in fake.calls] == [1, 2]
    assert {prompt["prompt_token_ids"][0] for prompt in fake.calls[1]["prompts"]} == {20, 30}
    assert results["first"][0].sequences[0].tokens == [11]
    assert results["second"][0].sequences[0].tokens == [21]
    assert results["third"][0].sequences[0].tokens == [32]


def test_a_failing_caller_does_not_fail_the_others_it_was_batched_with(
    sampler: VLLMSampler, tmp_path: Path
) -> None:
    from twinkle.samplers.vllm_sampler import _Ticket

    good, bad = (
        _Ticket([request([10], max_tokens=1, temperature=0.0)]),
        _Ticket([request([10], adapter_path=str(tmp_path / "gone"))]),
    )
    sampler._serve([good, bad])
    assert isinstance(bad.error, NotFound) and bad.results is None
    assert good.error is None and good.results is not None and good.results[0].sequences[0].tokens == [11]


# Without vLLM


def test_missing_vllm_and_gpu_are_named_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from twinkle.samplers import vllm_sampler

    real_find_spec = vllm_sampler.importlib.util.find_spec
    monkeypatch.setattr(
        vllm_sampler.importlib.util,
        "find_spec",
        lambda name: None if name == "vllm" else real_find_spec(name),
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_sampler.vllm_requirements_problem() == (
        "sampler_type: vllm needs vllm (pip install 'twinkle[vllm]') and a CUDA GPU; found: vllm is not "
        f"installed; torch {torch.__version__} (CUDA 12.8) sees no CUDA GPU."
    )


def test_the_module_loads_without_vllm_and_building_an_engine_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import twinkle.samplers.vllm_sampler as m\n"
        "print(sorted(name for name in sys.modules"
        " if name.split('.')[0] in ('vllm', 'torch', 'transformers')))\n"
        "try:\n"
        "    m.default_engine('/models/x', {})\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    loaded, refusal = out.splitlines()
    assert loaded == "['vllm']"  # only the blocked entry itself: nothing heavy was imported
    assert refusal.startswith("InvalidRequest sampler_type: vllm needs the vllm package")
    assert "pip install 'twinkle[vllm]'" in refusal
