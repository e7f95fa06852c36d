"""Preprocessors (dataset rows to trajectories) and the reward functions that go with them."""

from twinkle.preprocessor.base import (
    Preprocessor,
    ProcessorOutput,
    get_preprocessor,
    preprocessor_names,
    register_preprocessor,
)
from twinkle.preprocessor.dpo import DPOProcessor
from twinkle.preprocessor.gsm8k import GSM8KProcessor, gsm8k_ground_truth
from twinkle.preprocessor.latex_ocr import LatexOCRProcessor
from twinkle.preprocessor.pig_latin import PigLatinProcessor
from twinkle.preprocessor.rewards import extract_final_answer, format_reward, math_accuracy_reward
from twinkle.preprocessor.self_cognition import SelfCognitionProcessor

__all__ = [
    "DPOProcessor",
    "GSM8KProcessor",
    "LatexOCRProcessor",
    "PigLatinProcessor",
    "Preprocessor",
    "ProcessorOutput",
    "SelfCognitionProcessor",
    "extract_final_answer",
    "format_reward",
    "get_preprocessor",
    "gsm8k_ground_truth",
    "math_accuracy_reward",
    "preprocessor_names",
    "register_preprocessor",
]
