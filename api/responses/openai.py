"""Answers of the OpenAI-compatible routes (api/openai/routes.py), as OpenAI's API shapes them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from api.responses.answer import Answer

FinishReason = Literal["stop", "length"]


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(Answer):
    role: Literal["assistant"]
    content: str


class TokenLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(Answer):
    content: list[ChatTokenLogprob]


class ChatChoice(Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str = Field(description="As the request named it.")
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(Answer):
    """OpenAI's legacy logprobs: per token its text, logprob and most likely alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(Answer):
    id: str = Field(description="A served base model's name, or one of the caller's sampler checkpoint paths.")
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Answer):
    object: Literal["list"]
    data: list[ModelCard]
    first_id: str | None
    last_id: str | None
    has_more: bool


def streamed(model: type[Answer], chunk: str) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route answering `model`, or with `stream: true` server-sent events of `chunk`s."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {
        "type": "string",
        "description": f"With `stream: true`: `data: <{chunk} JSON>` events (and `: keep-alive` comments), "
                       "ending with `data: [DONE]`."}}}}}
