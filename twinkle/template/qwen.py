"""Qwen3.5 (and Qwen2.5/Qwen3, text and VL): ChatML written directly, without thinking blocks.

Qwen3-family chat templates insert `<think>...</think>` blocks into some assistant turns and not others,
so they do not render incrementally. Fine-tuning data here has no reasoning traces, so this template
writes plain ChatML itself:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

Tool results are wrapped in `<tool_response>` inside a user turn, as Qwen's own template does.
Images become `<|vision_start|><|image_pad|><|vision_end|>`, which Qwen-VL processors expand per patch.
"""

from __future__ import annotations

from pathlib import Path

from twinkle.data_format import Message
from twinkle.errors import InvalidRequest
from twinkle.template.base import Template, Truncation
from twinkle.template.segments import Segment, content_pieces

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_PAD = "<|image_pad|>"
VISION_PLACEHOLDER = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"


class Qwen3_5Template(Template):
    """Plain ChatML for Qwen models; the class name is the one the docs and configs use."""

    def __init__(
        self,
        model_id: str | Path,
        max_length: int | None = None,
        truncation: Truncation = "right",
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__(model_id, max_length, truncation, trust_remote_code)
        vocab = self.tokenizer.get_vocab()
        missing = [token for token in (IM_START, IM_END) if token not in vocab]
        if missing:
            raise InvalidRequest(
                f"{self.model_id} has no {' or '.join(missing)} token, so it is not a Qwen ChatML model.",
                hint="Use Template, which follows the model's own chat template.",
            )

    def render(self, messages: list[Message], add_generation_prompt: bool) -> list[Segment]:
        segments: list[Segment] = []
        for index, message in enumerate(messages):
            body = "".join(
                VISION_PLACEHOLDER if piece is None else piece for piece in content_pieces(message)
            )
            if message.role == "assistant":
                segments += [
                    Segment(f"{IM_START}assistant\n", False),
                    Segment(body + IM_END, True),
                    Segment("\n", False),
                ]
            elif message.role == "tool":
                segments.append(Segment(self._tool_response(messages, index, body), False))
            else:
                segments.append(Segment(f"{IM_START}{message.role}\n{body}{IM_END}\n", False))
        if add_generation_prompt:
            segments.append(Segment(f"{IM_START}assistant\n", False))
        return segments

    @staticmethod
    def _tool_response(messages: list[Message], index: int, body: str) -> str:
        """Tool results go back as a user turn; consecutive results share one turn, as Qwen's template does."""
        opens = index == 0 or messages[index - 1].role != "tool"
        closes = index == len(messages) - 1 or messages[index + 1].role != "tool"
        opening = f"{IM_START}user" if opens else ""
        closing = f"{IM_END}\n" if closes else ""
        return f"{opening}\n<tool_response>\n{body}\n</tool_response>{closing}"

    @property
    def image_token(self) -> str:
        return IMAGE_PAD
