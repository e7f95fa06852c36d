"""Preference rows (a prompt, a chosen and a rejected answer) as a positive and a negative trajectory."""

from __future__ import annotations

from twinkle.data_format import Message, Trajectory
from twinkle.preprocessor.base import Preprocessor, ProcessorOutput, Row, column, register_preprocessor


@register_preprocessor
class DPOProcessor(Preprocessor):
    """Each row yields [positive, negative], so a dataset's trajectories come as pairs [pos_1, neg_1, ...].

    `extra["preference"]` is "positive" or "negative" and `extra["pair_index"]` is 0 or 1 within the pair.
    """

    def __init__(
        self,
        chosen_key: str = "answer_zh",
        rejected_key: str = "answer_en",
        prompt_key: str = "prompt",
        system: str | None = None,
    ) -> None:
        self.chosen_key = chosen_key
        self.rejected_key = rejected_key
        self.prompt_key = prompt_key
        self.system = system

    def __call__(self, row: Row | Trajectory) -> ProcessorOutput:
        prompt = [Message("user", str(column(row, self.prompt_key, "DPOProcessor")))]
        if self.system is not None:
            prompt.insert(0, Message("system", self.system))
        answers = (
            ("positive", column(row, self.chosen_key, "DPOProcessor")),
            ("negative", column(row, self.rejected_key, "DPOProcessor")),
        )
        return [
            Trajectory(
                messages=[*prompt, Message("assistant", str(answer))],
                extra={"preference": preference, "pair_index": index},
            )
            for index, (preference, answer) in enumerate(answers)
        ]
