from __future__ import annotations

import pytest

from twinkle.data_format import Message, Trajectory
from twinkle.errors import InvalidRequest
from twinkle.preprocessor import (
    DPOProcessor,
    GSM8KProcessor,
    LatexOCRProcessor,
    PigLatinProcessor,
    SelfCognitionProcessor,
    format_reward,
    get_preprocessor,
    math_accuracy_reward,
    preprocessor_names,
)

from .conftest import DATA_DIR


def test_self_cognition_fills_the_placeholders_into_system_user_assistant() -> None:
    row = {"query": "{{NAME}}是谁开发的？", "response": "我是{{NAME}}，由{{AUTHOR}}开发。", "tag": "zh"}
    trajectory = SelfCognitionProcessor("twinkle模型", "ModelScope社区")(row)
    assert trajectory == Trajectory(
        messages=[
            Message("system", "You are a helpful assistant."),
            Message("user", "twinkle模型是谁开发的？"),
            Message("assistant", "我是twinkle模型，由ModelScope社区开发。"),
        ],
        extra={"tag": "zh"},
    )


def test_self_cognition_on_a_trajectory_fills_its_remaining_placeholders() -> None:
    trajectory = Trajectory(messages=[Message("assistant", "I am {{NAME}} by {{AUTHOR}}.")])
    filled = SelfCognitionProcessor("A", "B")(trajectory)
    assert isinstance(filled, Trajectory) and filled.messages[0].content == "I am A by B."


def test_gsm8k_keeps_the_prompt_and_carries_the_final_number_as_ground_truth() -> None:
    trajectory = GSM8KProcessor()(
        {"question": "What is 1,000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"}
    )
    assert isinstance(trajectory, Trajectory)
    assert [message.role for message in trajectory.messages] == ["system", "user"]
    assert trajectory.extra["ground_truth"] == "1234"
    with pytest.raises(InvalidRequest, match="####"):
        GSM8KProcessor()({"question": "q", "answer": "no final number"})


def test_dpo_yields_a_positive_then_a_negative_trajectory_with_configurable_keys() -> None:
    row = {"q": "Hi?", "good": "你好 👋", "bad": "Hello."}
    positive, negative = DPOProcessor(chosen_key="good", rejected_key="bad", prompt_key="q")(row)  # type: ignore[misc]
    assert positive.messages == [Message("user", "Hi?"), Message("assistant", "你好 👋")]
    assert negative.messages == [Message("user", "Hi?"), Message("assistant", "Hello.")]
    assert (positive.extra["preference"], negative.extra["preference"]) == ("positive", "negative")


def test_latex_ocr_attaches_the_image_itself_to_the_user_turn() -> None:
    image_path = DATA_DIR / "latex_ocr" / "images" / "formula_0.png"
    trajectory = LatexOCRProcessor()({"image": str(image_path), "text": "x^{2}+y^{2}=z^{2}"})
    assert isinstance(trajectory, Trajectory)
    user, assistant = trajectory.messages
    assert user.content == "<image>Using LaTeX to perform OCR on the image."
    assert user.images is not None and user.images[0].startswith("data:image/png;base64,")
    assert assistant == Message("assistant", "x^{2}+y^{2}=z^{2}")


def test_pig_latin_is_a_completion_with_the_documented_prompt() -> None:
    trajectory = PigLatinProcessor()({"input": "hello world", "output": "ellohay orldway"})
    assert isinstance(trajectory, Trajectory) and trajectory.format == "completion"
    assert [message.content for message in trajectory.messages] == [
        "English: hello world\nPig Latin:",
        " ellohay orldway\n\n",
    ]


def test_a_row_without_the_needed_column_names_the_columns_it_has() -> None:
    with pytest.raises(InvalidRequest, match=r"needs a 'query' column; this row has \['question'\]"):
        SelfCognitionProcessor("a", "b")({"question": "?"})


def test_the_registry_builds_by_name_and_lists_valid_names_on_a_typo() -> None:
    assert isinstance(get_preprocessor("DPOProcessor", chosen_key="x"), DPOProcessor)
    with pytest.raises(InvalidRequest) as raised:
        get_preprocessor("SelfCognitionProcesor")
    assert all(name in str(raised.value) for name in preprocessor_names())
    with pytest.raises(InvalidRequest, match="model_author"):
        get_preprocessor("SelfCognitionProcessor", model_name="only the name")


@pytest.mark.parametrize(
    ("completion", "ground_truth", "reward"),
    [
        ("3 + 4 = 7\n#### 7", "7", 1.0),
        ("so the answer is 1,234.\n#### $1,234", "1234", 1.0),
        ("The total is \\boxed{12}", "12", 1.0),
        ("I think 5 then 8", "8", 1.0),
        ("#### 7.0", "7", 1.0),
        ("3 + 4 = 7\n#### 8", "7", 0.0),
        ("no numbers at all", "7", 0.0),
    ],
)
def test_math_accuracy_compares_the_final_answer_as_a_number(
    completion: str, ground_truth: str, reward: float
) -> None:
    assert math_accuracy_reward(completion, ground_truth) == reward


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("3 + 4 = 7\n#### 7", 1.0),
        ("Half of 10 is 5.\n####  -2.5 ", 1.0),
        ("#### 7", 0.0),  # no working before the answer
        ("3 + 4 = 7", 0.0),
        ("#### 7 and then more text", 0.0),
    ],
)
def test_format_reward_wants_working_then_the_final_number_after_hashes(
    completion: str, reward: float
) -> None:
    assert format_reward(completion) == reward
