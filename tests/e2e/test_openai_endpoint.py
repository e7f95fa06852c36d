"""The official `openai` client against /v1 of a launched server: base model and trained adapters, chat and
text completions, streaming, and another tenant's adapter (404). Mock and transformers (torch sampler)."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from tests.harness import LaunchedServer
from twinkle.chat_tokenizer import ChatTokenizer

pytestmark = pytest.mark.e2e
OWNER, STRANGER = "tml-openai-owner", "tml-openai-stranger"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the world."}]


def client(server: LaunchedServer, key: str = OWNER) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def adapter_path(server: LaunchedServer) -> str:
    """A sampler checkpoint of OWNER, trained a few steps on one sentence."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key=OWNER)
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=8).result()
    tokens = list(range(5, 25))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    path: str = training.save_weights_for_sampler("openai-test").result().path
    return path


def test_the_model_list_names_the_base_model_and_the_callers_adapters(server: LaunchedServer,
                                                                      adapter_path: str) -> None:
    assert {"tiny-qwen", adapter_path} <= {m.id for m in client(server).models.list()}
    assert adapter_path not in {m.id for m in client(server, STRANGER).models.list()}


def test_a_chat_completion_applies_the_models_chat_template(server: LaunchedServer, tiny_model_dir) -> None:
    reply = client(server).chat.completions.create(model="tiny-qwen", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                                   temperature=0)
    tokenizer = ChatTokenizer(tiny_model_dir)
    prompt = tokenizer.encode(tokenizer.render(MESSAGES), add_special_tokens=False)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_an_adapter_streams_the_same_text_it_answers_at_once(server: LaunchedServer, adapter_path: str) -> None:
    c = client(server)
    whole = c.chat.completions.create(model=adapter_path, messages=MESSAGES, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    published = server.redis.pubsub()
    published.psubscribe(server.keys.sample_stream("*"))
    stream = c.chat.completions.create(model=adapter_path, messages=MESSAGES, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    kinds = []
    while message := published.get_message(timeout=0.5):
        kinds.append(message["type"])
    published.close()
    updates = kinds.count("pmessage")
    if server.config["applications"][1]["args"]["backend"] == "transformers" and whole.usage.completion_tokens > 1:  # type: ignore[union-attr]
        assert updates >= 1  # the torch sampler published tokens while it generated them
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_an_adapter_the_caller_does_not_own_is_not_found(server: LaunchedServer, adapter_path: str) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(server, STRANGER).chat.completions.create(model=adapter_path, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert "not found" in caught.value.message.lower()
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="no-such-model", prompt="hi", max_tokens=4)


def test_completions_score_a_prompt_with_echo_and_logprobs(server: LaunchedServer) -> None:
    """What lm-eval-harness's loglikelihood requests send: the prompt's own logprobs, no new tokens."""
    reply = client(server).completions.create(model="tiny-qwen", prompt="hello world, hello", max_tokens=0,
                                              echo=True, logprobs=1, temperature=0)
    choice = reply.choices[0]
    assert choice.text == "hello world, hello"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens or []) == choice.text


def test_completions_stream_text_for_several_prompts(server: LaunchedServer, adapter_path: str) -> None:
    stream = client(server).completions.create(model=adapter_path, prompt=["one two", "three"], max_tokens=5,
                                               temperature=0, stream=True)
    finished = {ch.choices[0].index for ch in stream if ch.choices and ch.choices[0].finish_reason}
    assert finished == {0, 1}


@pytest.mark.parametrize(("endpoint", "options", "named"), [
    ("chat", {"presence_penalty": 1.0}, "presence_penalty"),
    ("chat", {"logit_bias": {"5": 3.0}}, "logit_bias"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat", {"extra_body": {"min_p": 0.1}}, "min_p"),  # a parameter Twinkle does not know
    ("completions", {"suffix": "the end"}, "suffix"),
    ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("completions", {"n": 2, "best_of": 1}, "best_of"),
    ("completions", {"logprobs": 1, "stream": True}, "logprobs"),
])
def test_unsupported_options_are_refused_by_name(server: LaunchedServer, endpoint: str, options: dict[str, Any],
                                                 named: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client(server).chat.completions.create(model="tiny-qwen", messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
                                                   **options)
        else:
            client(server).completions.create(model="tiny-qwen", prompt="hi", max_tokens=2, **options)
    assert named in caught.value.message


def test_completion_logprobs_list_the_top_k_and_the_token_itself(server: LaunchedServer, adapter_path: str) -> None:
    reply = client(server).completions.create(model=adapter_path, prompt="one two", max_tokens=4, temperature=0,
                                              logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs and logprobs.token_logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the token is the most likely one


def test_chat_logprobs_carry_the_requested_top_logprobs(server: LaunchedServer, adapter_path: str) -> None:
    reply = client(server).chat.completions.create(model=adapter_path, messages=MESSAGES, max_tokens=4,  # type: ignore[arg-type]
                                                   temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and reply.usage is not None and len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_a_seed_repeats_a_completion_and_best_of_returns_the_n_best(server: LaunchedServer,
                                                                   adapter_path: str) -> None:
    c = client(server)
    first, again = (c.completions.create(model=adapter_path, prompt="one two", max_tokens=6, temperature=1.0, seed=11,
                                         n=2) for _ in range(2))
    assert [ch.text for ch in first.choices] == [ch.text for ch in again.choices]
    best = c.completions.create(model=adapter_path, prompt="one two", max_tokens=4, temperature=1.0, seed=5, n=2,
                                best_of=4, logprobs=0)
    assert len(best.choices) == 2 and best.usage is not None
    means = [np.mean(ch.logprobs.token_logprobs) for ch in best.choices]  # type: ignore[union-attr, arg-type]
    assert means == sorted(means, reverse=True)
    everything = c.completions.create(model=adapter_path, prompt="one two", max_tokens=4, temperature=1.0, seed=5,
                                      n=4, logprobs=0)
    assert max(np.mean(ch.logprobs.token_logprobs) for ch in everything.choices) == pytest.approx(means[0])  # type: ignore[union-attr, arg-type]
    assert best.usage.completion_tokens == everything.usage.completion_tokens  # type: ignore[union-attr]


def test_the_model_list_pages_checkpoints_newest_first_and_filters_by_run(server: LaunchedServer) -> None:
    key = "tml-openai-pages"
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    runs = [service.create_lora_training_client(base_model="tiny-qwen", rank=8) for _ in range(2)]
    paths = [training.result().save_weights_for_sampler(f"page-{i}").result().path
             for i in range(3) for training in runs]
    with httpx.Client(base_url=server.base_url + "/v1", headers={"Authorization": f"Bearer {key}"}) as http:
        first = http.get("/models", params={"limit": 3}).json()
        assert [m["id"] for m in first["data"]] == ["tiny-qwen", *paths[::-1][:2]] and first["has_more"]
        rest = http.get("/models", params={"limit": 100, "after": first["last_id"]}).json()
        assert [m["id"] for m in rest["data"]] == paths[::-1][2:] and not rest["has_more"]
        run = paths[0].split("/")[2]
        only = http.get("/models", params={"run": run}).json()["data"]
        assert [m["id"] for m in only] == [p for p in paths[::-1] if p.split("/")[2] == run]
        assert http.get("/models", params={"after": "nothing-like-it"}).status_code == 400
        assert http.get("/models", params={"order": "asc"}).status_code == 400
        assert http.get("/models", params={"run": "someone-elses"}).status_code == 404
