from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel

from tests.client.fake_server import FakeTwinkleServer
from twinkle.data_format import Message, Trajectory
from twinkle_client import InvalidArgument, RequestFailed, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import Sampler, sampling_params_body, vLLMSampler


class CharTemplate:
    """A template stand-in: one token per character of the last message, decoded back to characters."""

    def encode(self, trajectory: Any, add_generation_prompt: bool = False) -> dict[str, Any]:
        if not isinstance(trajectory, Trajectory):
            trajectory = Trajectory.model_validate(trajectory)
        text = trajectory.messages[-1].content
        self.generation_prompt = add_generation_prompt
        return {"input_ids": np.array([ord(c) % 50 for c in text], dtype=np.int64)}

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in tokens)


class TinkerLikeParams(BaseModel):
    max_tokens: int | None = None
    temperature: float | None = None
    stop: list[str] | None = None


@pytest.fixture
def sampler(client: TwinkleClient) -> Sampler:
    return Sampler("ms://Qwen/Qwen3.5-4B")


def test_vllm_sampler_is_the_same_class() -> None:
    assert vLLMSampler is Sampler


def test_token_ids_are_sampled_from_the_base_model(sampler: Sampler, server: FakeTwinkleServer) -> None:
    result = sampler.sample([1, 2, 3], sampling_params={"max_tokens": 3, "temperature": 0.0}, num_samples=2)
    body = server.sent("/asample")[0].body
    assert body["base_model"] == "Qwen/Qwen3.5-4B" and "model_path" not in body
    assert body["prompt"] == {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    assert body["sampling_params"] == {"max_tokens": 3, "temperature": 0.0} and body["num_samples"] == 2
    assert [s.tokens for s in result.sequences] == [[3, 2, 1], [4, 3, 2]]
    assert result.sequences[0].logprobs == [-0.5] * 3 and result.sequences[0].stop_reason == "length"
    assert result.sequences[0].text is None


def test_an_adapter_checkpoint_is_sampled_by_its_twinkle_path(
    sampler: Sampler, server: FakeTwinkleServer
) -> None:
    model = MultiLoraTransformersModel("Qwen/Qwen3.5-4B")
    model.add_adapter_to_model("default", {"r": 4})
    path = model.save("for-sampling", is_sampler=True)
    sampler.sample(np.array([5, 6]), adapter_path=path, logprobs=False)
    body = server.sent("/asample")[0].body
    assert body["model_path"] == path and "base_model" not in body
    with pytest.raises(RequestFailed, match="not found"):
        sampler.sample([5, 6], adapter_path="twinkle://nope/weights/x")


def test_a_list_of_prompts_gives_a_list_of_results(sampler: Sampler, server: FakeTwinkleServer) -> None:
    results = sampler.sample([[1, 2], {"input_ids": np.array([7, 8, 9])}], sampling_params={"max_tokens": 8})
    assert isinstance(results, list) and [r.sequences[0].tokens for r in results] == [[2, 1], [9, 8, 7]]


def test_logprobs_false_drops_them_and_prompt_logprobs_are_requested(sampler: Sampler) -> None:
    result = sampler.sample([1, 2, 3], logprobs=False, prompt_logprobs=True)
    assert result.sequences[0].logprobs is None and result.prompt_logprobs == [None, -1.0, -1.0]


def test_trajectories_need_a_template_and_come_back_decoded(
    sampler: Sampler, server: FakeTwinkleServer
) -> None:
    trajectory = Trajectory(messages=[Message("user", "abc")])
    with pytest.raises(InvalidArgument, match="set_template"):
        sampler.sample(trajectory)
    template = CharTemplate()
    sampler.set_template(template)
    result = sampler.sample(trajectory, sampling_params={"max_tokens": 8})
    assert template.generation_prompt is True
    assert server.sent("/asample")[0].body["prompt"]["chunks"][0]["tokens"] == [47, 48, 49]
    assert result.sequences[0].text == "xwv"


def test_sampling_params_come_from_dicts_pydantic_models_and_dataclasses() -> None:
    @dataclasses.dataclass
    class Params:
        max_tokens: int = 16
        seed: int | None = None

    assert sampling_params_body(TinkerLikeParams(max_tokens=4, stop=["\n"])) == {
        "max_tokens": 4,
        "stop": ["\n"],
    }
    assert sampling_params_body(Params()) == {"max_tokens": 16}
    assert sampling_params_body(None) == {}
    with pytest.raises(InvalidArgument, match=r"Unknown sampling params \['n'\]"):
        sampling_params_body({"n": 4})


def test_text_and_empty_prompts_are_refused(sampler: Sampler) -> None:
    with pytest.raises(InvalidArgument, match="not text"):
        sampler.sample("hello")
    with pytest.raises(InvalidArgument, match="non-empty list of token ids"):
        sampler.sample(np.array([], dtype=np.int64))


def test_a_model_without_a_sampler_is_refused(server: FakeTwinkleServer) -> None:
    no_sampler = FakeTwinkleServer(sampleable=False)
    with (
        TwinkleClient("http://t", no_sampler.api_key, transport=no_sampler.transport()) as client,
        pytest.raises(InvalidArgument, match="no sampler"),
    ):
        Sampler("Qwen/Qwen3.5-4B", client=client)
