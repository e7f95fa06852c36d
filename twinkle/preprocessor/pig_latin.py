"""English to Pig Latin pairs (`input`, `output`) as prompt/completion text, without a chat template."""

from __future__ import annotations

from twinkle.data_format import Message, Trajectory
from twinkle.preprocessor.base import Preprocessor, ProcessorOutput, Row, column, register_preprocessor


@register_preprocessor
class PigLatinProcessor(Preprocessor):
    """Prompt `English: {input}\\nPig Latin:`, completion ` {output}\\n\\n`; only the completion is trained on."""

    def __call__(self, row: Row | Trajectory) -> ProcessorOutput:
        english = str(column(row, "input", "PigLatinProcessor"))
        pig_latin = str(column(row, "output", "PigLatinProcessor"))
        return Trajectory(
            messages=[
                Message("user", f"English: {english}\nPig Latin:"),
                Message("assistant", f" {pig_latin}\n\n"),
            ],
            format="completion",
        )
