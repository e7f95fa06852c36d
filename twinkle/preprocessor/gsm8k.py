"""GSM8K rows (`question`, `answer` ending in `#### <number>`) as prompts for on-policy sampling."""

from __future__ import annotations

import re

from twinkle.data_format import Message, Trajectory
from twinkle.errors import InvalidRequest
from twinkle.preprocessor.base import Preprocessor, ProcessorOutput, Row, column, register_preprocessor

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Solve the math problem step by step, "
    "then give the final answer on the last line as '#### <number>'."
)
FINAL_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def gsm8k_ground_truth(answer: str) -> str:
    """The number after `####` in a GSM8K answer, without thousands separators."""
    match = FINAL_ANSWER.search(answer)
    if match is None:
        raise InvalidRequest(
            f"GSM8K answer {answer[-80:]!r} does not end with '#### <number>'.",
            hint="Each answer must end with its final number after ####.",
        )
    return match.group(1).replace(",", "").strip()


@register_preprocessor
class GSM8KProcessor(Preprocessor):
    """system + user (`question`) only: the assistant turn is sampled. The number after `####` travels in
    `extra["ground_truth"]` for the reward function, the whole worked answer in `extra["solution"]`."""

    def __init__(self, system: str = DEFAULT_SYSTEM) -> None:
        self.system = system

    def __call__(self, row: Row | Trajectory) -> ProcessorOutput:
        question = str(column(row, "question", "GSM8KProcessor"))
        answer = str(column(row, "answer", "GSM8KProcessor"))
        return Trajectory(
            messages=[Message("system", self.system), Message("user", question)],
            extra={"ground_truth": gsm8k_ground_truth(answer), "solution": answer},
        )
