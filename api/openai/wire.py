"""OpenAI API request bodies and response shapes (chat completions, completions, models).

Every parameter of OpenAI's chat completions and completions requests is either honoured or refused by name
(400, `refused()`), never dropped: a field Twinkle does not know is refused when it carries a value (null
counts as not sent, as some clients send every field). Three are accepted and have no effect on the output,
as at OpenAI: `user`, `safety_identifier` and `prompt_cache_key` (there is no prompt cache here).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16
MAX_STOP = 8
MAX_TOP_LOGPROBS = 20  # chat top_logprobs, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs, as OpenAI allows


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def unknown(self, where: str = "") -> list[str]:
        """Fields Twinkle does not know that were sent with a value, each named (with `where` before it)."""
        return [f"{where}{name}" for name, value in (self.model_extra or {}).items() if value is not None]


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
    include_obfuscation: bool | None = None  # only false (or unset): chunks carry no obfuscation field


class SamplingFields(Body):
    model: str = Field(min_length=1, max_length=1000)
    max_tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)  # vLLM's extension; -1 or 0 = off
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # accepted, no effect on the output (as at OpenAI, where they serve abuse monitoring and cache routing)
    user: str | None = Field(default=None, max_length=500)
    safety_identifier: str | None = Field(default=None, max_length=500)
    prompt_cache_key: str | None = Field(default=None, max_length=500)
    service_tier: str | None = Field(default=None, max_length=100)
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def refused(self) -> list[str]:
        """Every parameter sent that Twinkle cannot honour, as `name (why)`; empty when it honours them all."""
        out = [f"{name} (unknown to Twinkle)" for name in self.unknown()]
        out += [f"{name} (penalties are not implemented)"
                for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        if self.logit_bias:
            out.append("logit_bias (not implemented)")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            out.append(f"stop (at most {MAX_STOP} sequences, got {len(stops)})")
        if self.stream_options is not None:
            if not self.stream:
                out.append("stream_options (only with stream: true)")
            out += [f"{name} (unknown to Twinkle)" for name in self.stream_options.unknown("stream_options.")]
            if self.stream_options.include_obfuscation:
                out.append("stream_options.include_obfuscation (chunks carry no obfuscation field; send false)")
        if self.stream and self.wants_logprobs():
            out.append("logprobs with stream: true (logprobs come with whole answers only; do not stream)")
        if self.service_tier not in (None, "auto", "default"):
            out.append(f"service_tier {self.service_tier!r} (one tier here: auto or default)")
        if self.store:
            out.append("store (completions are not stored)")
        if self.metadata:
            out.append("metadata (only stored completions keep metadata)")
        return out


class ChatCompletionBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # no tools are ever called, in parallel or not
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def max_new_tokens(self, default: int) -> int:
        chosen = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return default if chosen is None else chosen

    def refused(self) -> list[str]:
        out = super().refused()
        for index, message in enumerate(self.messages):
            out += [f"{name} (unknown to Twinkle)" for name in message.unknown(f"messages[{index}].")]
            for part_index, part in enumerate(message.content if isinstance(message.content, list) else []):
                where = f"messages[{index}].content[{part_index}]."
                out += [f"{name} (unknown to Twinkle)" for name in part.unknown(where)]
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(self, name) == 0:
                out.append(f"{name} (at least 1 for chat)")
        if self.top_logprobs and not self.logprobs:
            out.append("top_logprobs (needs logprobs: true)")
        if self.tools:
            out.append("tools (no tool calling)")
        if self.tool_choice not in (None, "none", "auto"):
            out.append("tool_choice (no tool calling; only none or auto)")
        if self.functions:
            out.append("functions (no function calling)")
        if self.function_call not in (None, "none", "auto"):
            out.append("function_call (no function calling; only none or auto)")
        if self.response_format not in (None, {"type": "text"}):
            out.append("response_format (text only: no JSON mode or schemas)")
        if self.modalities not in (None, ["text"]):
            out.append("modalities (text only)")
        return out


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def samples(self) -> int:
        """How many completions to generate per prompt: best_of, of which the n best are returned."""
        return self.best_of or self.n

    def refused(self) -> list[str]:
        out = super().refused()
        if self.suffix:
            out.append("suffix (no insertion)")
        if self.best_of is not None and self.best_of < self.n:
            out.append(f"best_of ({self.best_of} is less than n {self.n})")
        if self.stream and self.samples() > self.n:
            out.append("best_of with stream: true (the best are known only at the end; do not stream)")
        return out


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
