"""Reward functions for GRPO on math prompts: is the final answer right, and is it given in the asked form.

The asked form is the GSM8K one: working, then the final number on the last line after `####`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+"
MARKED_ANSWER = re.compile(rf"####\s*({NUMBER})")
BOXED_ANSWER = re.compile(rf"\\boxed\{{\s*({NUMBER})\s*\}}")
ANY_NUMBER = re.compile(NUMBER)
FINAL_LINE = re.compile(rf"####\s*(?:{NUMBER})\s*\.?\s*$")


def extract_final_answer(completion_text: str) -> str | None:
    """The answer a completion gives: after its last `####`, else in its last `\\boxed{}`, else its last number."""
    for pattern in (MARKED_ANSWER, BOXED_ANSWER, ANY_NUMBER):
        found = pattern.findall(completion_text)
        if found:
            return str(found[-1])
    return None


def parse_number(text: str | float) -> Decimal | None:
    """A number from `1,234`, `$5`, `7.` or `-3.50`; None when the text is no number."""
    cleaned = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def math_accuracy_reward(completion_text: str, ground_truth: str | float) -> float:
    """1.0 when the completion's final answer equals the ground truth as a number, else 0.0."""
    answer = extract_final_answer(completion_text)
    expected = parse_number(ground_truth)
    if answer is None or expected is None:
        return 0.0
    given = parse_number(answer)
    return 1.0 if given is not None and given == expected else 0.0


def format_reward(completion_text: str) -> float:
    """1.0 when the completion ends with `#### <number>` after some working, else 0.0."""
    text = completion_text.strip()
    marker = text.rfind("####")
    if marker <= 0 or not text[:marker].strip():
        return 0.0
    return 1.0 if FINAL_LINE.search(text) else 0.0
