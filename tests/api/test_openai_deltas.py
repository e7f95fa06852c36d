"""Streamed text deltas never show what the final answer takes back (a stop sequence, half a character)."""

from __future__ import annotations

from pathlib import Path

from api.openai.choices import Choice, cut_at_stop
from api.openai.streaming import DeltaText
from twinkle.chat_tokenizer import ChatTokenizer


def stream(tokenizer: ChatTokenizer, tokens: list[int], stops: list[str], streamed: int) -> list[str]:
    """Deltas when the first `streamed` tokens were previewed one by one, then the final choice arrived."""
    delta = DeltaText(tokenizer, stops)
    pieces = [p for end in range(1, streamed + 1) if (p := delta.grow(tokens[:end]))]
    text, stopped = cut_at_stop(tokenizer.decode(tokens), stops)
    return pieces + delta.finish(Choice(text, "stop" if stopped else "length", tokens, [0.0] * len(tokens)))


def test_deltas_add_up_to_the_final_text_however_much_was_previewed(tiny_model_dir: Path) -> None:
    tokenizer = ChatTokenizer(tiny_model_dir)
    tokens = tokenizer.encode("hello world, naïve café END and more", add_special_tokens=False)
    for stops, expected in (([], "hello world, naïve café END and more"), (["END"], "hello world, naïve café ")):
        for streamed in range(len(tokens) + 1):
            pieces = stream(tokenizer, tokens, stops, streamed)
            assert "".join(pieces) == expected, (stops, streamed, pieces)
            assert all(pieces)


def test_a_preview_holds_back_what_could_begin_a_stop_sequence(tiny_model_dir: Path) -> None:
    tokenizer = ChatTokenizer(tiny_model_dir)
    tokens = tokenizer.encode("abc XYZ", add_special_tokens=False)
    delta = DeltaText(tokenizer, ["XYZ"])
    shown = "".join(delta.grow(tokens[:end]) for end in range(1, len(tokens) + 1))
    assert "X" not in shown and "abc".startswith(shown.strip()[:3])
