"""A sample op's output as OpenAI choices: each sequence's text, cut at the first stop string, and its logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twinkle.chat_tokenizer import ChatTokenizer
from twinkle.types import SampleOutput


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """OpenAI leaves the stop sequence out of the text."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@dataclass
class Choice:
    text: str
    finish_reason: str
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None  # each token's top-k alternatives, when asked for

    def mean_logprob(self) -> float:
        """Log probability per token, by which best_of ranks completions (0 for none)."""
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else 0.0


def choices_of(out: SampleOutput, tokenizer: ChatTokenizer, stops: Sequence[str], keep_tokens: bool = True
               ) -> list[Choice]:
    choices = []
    for seq in out.sequences:
        tokens = list(seq.tokens) if keep_tokens else []
        text, stopped = cut_at_stop(tokenizer.decode(tokens), stops)
        reason = "stop" if stopped or seq.stop_reason == "stop" else "length"
        top = list(seq.topk_logprobs)[: len(tokens)] if seq.topk_logprobs is not None else None
        choices.append(Choice(text, reason, tokens, list(seq.logprobs)[: len(tokens)], top))
    return choices
