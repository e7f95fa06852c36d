"""Every parameter the `openai` package can send to /v1/chat/completions and /v1/completions is either
honoured or refused by name: none is dropped silently or replaced by a default."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from api.openai.wire import ChatCompletionBody, CompletionBody

CHAT: dict[str, Any] = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "tiny-qwen", "prompt": "hi"}

# A value Twinkle honours (a non-default one where there is one), per parameter.
HONOURED: dict[str, dict[str, Any]] = {
    "model": {}, "messages": {}, "prompt": {},
    "max_tokens": {"max_tokens": 8}, "max_completion_tokens": {"max_completion_tokens": 8},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "n": {"n": 3}, "stop": {"stop": ["x", "y"]},
    "seed": {"seed": 7}, "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "logprobs": {"logprobs": True}, "top_logprobs": {"logprobs": True, "top_logprobs": 5},
    "echo": {"echo": True}, "best_of": {"n": 2, "best_of": 4},
    "user": {"user": "u-1"}, "safety_identifier": {"safety_identifier": "s-1"},
    "prompt_cache_key": {"prompt_cache_key": "k"}, "service_tier": {"service_tier": "auto"},
    "store": {"store": False}, "metadata": {"metadata": {}},
    "frequency_penalty": {"frequency_penalty": 0.0}, "presence_penalty": {"presence_penalty": 0.0},
    "logit_bias": {"logit_bias": {}}, "suffix": {"suffix": ""},
    "tool_choice": {"tool_choice": "none"}, "parallel_tool_calls": {"parallel_tool_calls": False},
    "function_call": {"function_call": "none"}, "response_format": {"response_format": {"type": "text"}},
    "modalities": {"modalities": ["text"]},
}

# A value Twinkle refuses, per parameter; the 400 names the parameter.
REFUSED: dict[str, dict[str, Any]] = {
    "frequency_penalty": {"frequency_penalty": 0.5}, "presence_penalty": {"presence_penalty": -0.5},
    "logit_bias": {"logit_bias": {"5": 10}}, "suffix": {"suffix": "the end"},
    "best_of": {"n": 3, "best_of": 2}, "stop": {"stop": [str(i) for i in range(9)]},
    "stream_options": {"stream_options": {"include_usage": True}},  # without stream
    "logprobs": {"stream": True, "logprobs": 2}, "top_logprobs": {"top_logprobs": 2},  # without logprobs
    "max_completion_tokens": {"max_completion_tokens": 0},
    "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "tool_choice": {"tool_choice": "required"}, "functions": {"functions": [{"name": "f"}]},
    "function_call": {"function_call": {"name": "f"}}, "response_format": {"response_format": {"type": "json_object"}},
    "modalities": {"modalities": ["text", "audio"]}, "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "prediction": {"prediction": {"type": "content", "content": "x"}}, "reasoning_effort": {"reasoning_effort": "low"},
    "verbosity": {"verbosity": "low"}, "web_search_options": {"web_search_options": {}},
    "moderation": {"moderation": {"model": "x"}}, "prompt_cache_options": {"prompt_cache_options": {"a": 1}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"}, "store": {"store": True},
    "metadata": {"metadata": {"a": "b"}}, "service_tier": {"service_tier": "flex"},
}


# Where chat refuses another value than completions (completions take max_tokens 0 to score a prompt).
CHAT_REFUSED: dict[str, dict[str, Any]] = {"logprobs": {"stream": True, "logprobs": True},
                                           "max_tokens": {"max_tokens": 0}}


def _fields(module: Any) -> list[str]:
    return sorted(module.CompletionCreateParamsBase.__annotations__)


def _body(kind: str, extra: dict[str, Any]) -> ChatCompletionBody | CompletionBody:
    if kind == "chat":
        return ChatCompletionBody.model_validate({**CHAT, **extra})
    return CompletionBody.model_validate({**COMPLETION, **extra})


@pytest.mark.parametrize(("kind", "name"), [("chat", n) for n in _fields(chat_create_params)]
                         + [("completions", n) for n in _fields(completion_create_params)])
def test_every_openai_parameter_is_honoured_or_refused_by_name(kind: str, name: str) -> None:
    assert name in HONOURED or name in REFUSED, f"{kind} parameter {name} is neither honoured nor refused"
    if name in HONOURED:
        assert _body(kind, HONOURED[name]).refused() == []
    refusing = {**REFUSED, **CHAT_REFUSED}.get(name) if kind == "chat" else REFUSED.get(name)
    if refusing is not None:
        refused = _body(kind, refusing).refused()
        assert any(reason.startswith(name) for reason in refused), refused


def test_a_parameter_sent_as_null_counts_as_unset() -> None:
    body = _body("chat", {"tools": None, "reasoning_effort": None, "audio": None, "logit_bias": None})
    assert body.refused() == []


def test_unknown_fields_inside_messages_and_stream_options_are_refused_by_path() -> None:
    body = _body("chat", {"messages": [{"role": "assistant", "content": [{"type": "text", "text": "a",
                                                                           "cache_control": {}}],
                                        "tool_calls": [{"id": "1"}], "refusal": None}],
                          "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}})
    refused = body.refused()
    assert any(r.startswith("messages[0].tool_calls") for r in refused)
    assert any(r.startswith("messages[0].content[0].cache_control") for r in refused)
    assert any(r.startswith("stream_options.include_obfuscation") for r in refused)
    assert not any("refusal" in r for r in refused)


def test_chat_max_tokens_zero_is_refused_rather_than_replaced_by_the_default() -> None:
    assert _body("chat", {}).max_new_tokens(512) == 512
    assert _body("chat", {"max_tokens": 9}).max_new_tokens(512) == 9
    assert _body("chat", {"max_tokens": 9, "max_completion_tokens": 4}).max_new_tokens(512) == 4


def test_best_of_generates_more_samples_than_it_returns() -> None:
    body = _body("completions", {"n": 2, "best_of": 5})
    assert isinstance(body, CompletionBody) and (body.samples(), body.n) == (5, 2)
    streamed = _body("completions", {"n": 2, "best_of": 5, "stream": True}).refused()
    assert any(r.startswith("best_of with stream") for r in streamed)
