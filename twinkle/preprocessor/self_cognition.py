"""Self-cognition rows (`query`, `response` with {{NAME}} and {{AUTHOR}}) as chats naming your model."""

from __future__ import annotations

from twinkle.data_format import Message, Trajectory
from twinkle.preprocessor.base import Preprocessor, ProcessorOutput, Row, column, register_preprocessor

DEFAULT_SYSTEM = "You are a helpful assistant."


@register_preprocessor
class SelfCognitionProcessor(Preprocessor):
    """system + user (`query`) + assistant (`response`), with the placeholders replaced.

    Given a trajectory instead of a row, it replaces the placeholders in its messages, so mapping it twice
    is harmless.
    """

    def __init__(self, model_name: str, model_author: str, system: str = DEFAULT_SYSTEM) -> None:
        self.model_name = model_name
        self.model_author = model_author
        self.system = system

    def fill(self, text: str) -> str:
        return text.replace("{{NAME}}", self.model_name).replace("{{AUTHOR}}", self.model_author)

    def __call__(self, row: Row | Trajectory) -> ProcessorOutput:
        if isinstance(row, Trajectory):
            messages = [
                message.model_copy(update={"content": self.fill(message.content)}) for message in row.messages
            ]
            return row.model_copy(update={"messages": messages})
        query = self.fill(str(column(row, "query", "SelfCognitionProcessor")))
        response = self.fill(str(column(row, "response", "SelfCognitionProcessor")))
        extra = {"tag": row["tag"]} if row.get("tag") is not None else {}
        return Trajectory(
            messages=[Message("system", self.system), Message("user", query), Message("assistant", response)],
            extra=extra,
        )
