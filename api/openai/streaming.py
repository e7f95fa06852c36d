"""Server-sent events of the OpenAI routes: the framing, and each choice's text as it grows token by token.

A failure after the stream started becomes an error event, since the status code is already sent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from api.openai import wire
from api.openai.choices import Choice, cut_at_stop
from twinkle.chat_tokenizer import ChatTokenizer
from twinkle.errors import TwinkleError

KEEPALIVE_SECONDS = 10.0


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(_guarded(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the stream started cannot change the status code any more: it becomes an error event,
    as OpenAI sends one, and the stream ends."""
    try:
        async for event in events:
            yield event
    except TwinkleError as exc:
        yield sse_event(wire.error_body(str(exc), "invalid_request_error" if exc.category == "user"
                                        else "server_error", exc.code))
        yield "data: [DONE]\n\n"


class DeltaText:
    """One choice's text, sent as deltas: grown from the tokens streamed so far, completed from the output.

    A preview never shows what the output may still take back: text past a stop sequence, the last
    characters that could begin one, or a character whose bytes are still incomplete."""

    def __init__(self, tokenizer: ChatTokenizer, stops: Sequence[str], *, keep: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.keep = keep  # False: max_tokens 0, no generated text is shown
        self.shown = ""

    def grow(self, tokens: list[int]) -> str:
        if not self.keep:
            return ""
        text, stopped = cut_at_stop(self.tokenizer.decode(tokens), self.stops)
        text = text.rstrip("\ufffd")
        if not stopped and self.hold:
            text = text[: max(0, len(text) - self.hold)]
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece

    def finish(self, choice: Choice) -> list[str]:
        """What the client has not seen yet: per-token deltas when nothing was streamed, else the rest."""
        if not self.shown:
            self.shown = choice.text
            return _pieces(choice, self.tokenizer)
        if not choice.text.startswith(self.shown):
            return []  # decoding that does not grow by prefixes; nothing sent can be taken back
        rest, self.shown = choice.text[len(self.shown) :], choice.text
        return [rest] if rest else []


def _pieces(choice: Choice, tokenizer: ChatTokenizer) -> list[str]:
    """The text as per-token deltas; a token that ends inside a multi-byte character waits for the next."""
    pieces, shown = [], ""
    for end in range(1, len(choice.tokens) + 1):
        text = tokenizer.decode(choice.tokens[:end])
        if text.endswith("\ufffd") or not text.startswith(shown):
            continue
        piece, shown = text[len(shown) :], text
        if len(shown) > len(choice.text):  # past a stop sequence
            piece = piece[: max(0, len(choice.text) - (len(shown) - len(piece)))]
        if piece:
            pieces.append(piece)
        if len(shown) >= len(choice.text):
            break
    if "".join(pieces) != choice.text:  # decoding that does not grow by prefixes: send the whole text
        return [choice.text] if choice.text else []
    return pieces
