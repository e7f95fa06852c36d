"""OpenAI API request bodies and response shapes (chat completions, completions, models).

Unknown fields are ignored, as OpenAI clients send many optional ones; every field Twinkle uses is typed and
range-checked, and the ones it cannot honour (penalties, logit_bias, tools) are refused by name when set.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16
MAX_STOP = 8


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class TextPart(Body):
    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None)
    name: str | None = Field(default=None, max_length=200)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    model: str = Field(min_length=1, max_length=1000)
    max_tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)  # vLLM's extension; -1 = off
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=500)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops[:MAX_STOP] if s)

    def unsupported(self) -> list[str]:
        names = [n for n in ("presence_penalty", "frequency_penalty") if getattr(self, n)]
        return names + (["logit_bias"] if self.logit_bias else [])


class ChatCompletionBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["tools"] if self.tools else []) + (
            ["top_logprobs"] if self.top_logprobs else [])


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["suffix"] if self.suffix else [])


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, ident: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": ident, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}


def model_entry(name: str, owned_by: str, created: float = 0.0) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(created), "owned_by": owned_by}


def error_body(message: str, kind: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape, which its clients read the message from."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
