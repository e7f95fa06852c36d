from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from twinkle.data_format import IGNORE_INDEX, Message, Trajectory
from twinkle.errors import InvalidRequest
from twinkle.template import Qwen3_5Template, Template, get_template, template_names

CONVERSATION = Trajectory(
    messages=[
        Message("system", "You are a helpful assistant."),
        Message("user", "你是谁？"),
        Message("assistant", "我是twinkle模型, made by ModelScope."),
        Message("user", "What is 2 + 3?"),
        Message("assistant", "2 + 3 = 5."),
    ],
    extra={"id": 7},
)


def trained_spans(template: Template, input_ids: np.ndarray, labels: np.ndarray) -> list[str]:
    """The decoded text of each run of consecutive labelled tokens."""
    spans: list[list[int]] = []
    previous_trained = False
    for token, label in zip(input_ids.tolist(), labels.tolist(), strict=True):
        trained = label != IGNORE_INDEX
        if trained:
            assert label == token
            if not previous_trained:
                spans.append([])
            spans[-1].append(token)
        previous_trained = trained
    return [template.decode(span, skip_special_tokens=False) for span in spans]


@pytest.fixture(params=["qwen", "chat"])
def template(request: pytest.FixtureRequest, qwen_template: Template, chat_template: Template) -> Template:
    return qwen_template if request.param == "qwen" else chat_template


def test_only_assistant_content_and_its_end_token_carry_labels(template: Template) -> None:
    feature = template.encode(CONVERSATION)
    assert trained_spans(template, feature["input_ids"], feature["labels"]) == [
        "我是twinkle模型, made by ModelScope.<|im_end|>",
        "2 + 3 = 5.<|im_end|>",
    ]
    assert feature["input_ids"].dtype == np.int64 and feature["labels"].dtype == np.int64
    np.testing.assert_array_equal(feature["attention_mask"], np.ones_like(feature["input_ids"]))
    assert feature["extra"] == {"id": 7}


def test_the_encoded_tokens_are_the_chatml_text_tokenized_at_once(template: Template) -> None:
    feature = template.encode(CONVERSATION)
    text = template.decode(feature["input_ids"], skip_special_tokens=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n你是谁？<|im_end|>\n"
        "<|im_start|>assistant\n我是twinkle模型, made by ModelScope.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n"
    )
    whole = template.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert feature["input_ids"].tolist() == whole


def test_a_generation_prompt_ends_with_an_open_assistant_turn_and_trains_nothing(template: Template) -> None:
    prompt = Trajectory(
        messages=[Message("system", "You are a helpful assistant"), Message("user", "你是谁？")]
    )
    features = template.batch_encode([prompt, prompt], add_generation_prompt=True)
    assert len(features) == 2
    text = template.decode(features[0]["input_ids"].tolist(), skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\n你是谁？<|im_end|>\n<|im_start|>assistant\n")
    assert (features[0]["labels"] == IGNORE_INDEX).all()
    assert (
        template.decode(features[0]["input_ids"])
        == "system\nYou are a helpful assistant\nuser\n你是谁？\nassistant\n"
    )


def test_completion_trajectories_train_on_the_completion_text_only_with_no_end_token(
    qwen_template: Template,
) -> None:
    trajectory = Trajectory(
        messages=[
            Message("user", "English: hello world\nPig Latin:"),
            Message("assistant", " ellohay orldway\n\n"),
        ],
        format="completion",
    )
    feature = qwen_template.encode(trajectory)
    assert qwen_template.decode(feature["input_ids"], skip_special_tokens=False) == (
        "English: hello world\nPig Latin: ellohay orldway\n\n"
    )
    assert trained_spans(qwen_template, feature["input_ids"], feature["labels"]) == [" ellohay orldway\n\n"]


@pytest.mark.parametrize("truncation", ["right", "left"])
def test_truncation_keeps_max_length_tokens_from_the_chosen_end(
    tiny_model_dir: Path, truncation: str
) -> None:
    full = Qwen3_5Template(model_id=str(tiny_model_dir)).encode(CONVERSATION)
    cut = Qwen3_5Template(model_id=str(tiny_model_dir), max_length=10, truncation=truncation).encode(
        CONVERSATION
    )  # type: ignore[arg-type]
    kept = slice(0, 10) if truncation == "right" else slice(-10, None)
    for key in ("input_ids", "labels", "attention_mask"):
        np.testing.assert_array_equal(cut[key], full[key][kept])  # type: ignore[literal-required]


def test_truncation_error_refuses_an_overlong_trajectory(tiny_model_dir: Path) -> None:
    template = Qwen3_5Template(model_id=str(tiny_model_dir), max_length=10, truncation="error")
    with pytest.raises(InvalidRequest, match="max_length=10"):
        template.encode(CONVERSATION)


def test_images_expand_to_masked_slots_with_pixel_values(tiny_vision_model_dir: Path) -> None:
    from PIL import Image

    template = get_template("Qwen3_5Template", model_id=str(tiny_vision_model_dir), max_length=256)
    trajectory = Trajectory(
        messages=[
            Message(
                "user", "<image>Using LaTeX to perform OCR on the image.", images=[Image.new("RGB", (60, 20))]
            ),
            Message("assistant", "x^{2}"),
        ]
    )
    feature = template.encode(trajectory)
    image_slots = feature["input_ids"] == template.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert image_slots.sum() == 16  # the tiny processor's 56x56 image in 14x14 patches
    assert (feature["labels"][image_slots] == IGNORE_INDEX).all()
    assert feature["pixel_values"].shape == (1, 3, 56, 56)
    assert feature["images"] == trajectory.messages[0].images
    assert trained_spans(template, feature["input_ids"], feature["labels"]) == ["x^{2}<|im_end|>"]


def test_a_text_only_model_refuses_images(qwen_template: Template) -> None:
    trajectory = Trajectory(
        messages=[Message("user", "look", images=[b"\x89PNG"]), Message("assistant", "ok")]
    )
    with pytest.raises(InvalidRequest, match=r"text only|no processor"):
        qwen_template.encode(trajectory)


def test_the_generic_template_refuses_a_chat_template_that_rewrites_earlier_turns(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "rewriting"
    shutil.copytree(tiny_model_dir, model_dir)
    # Like Qwen3's thinking blocks: only the last assistant turn gets a prefix, so prefixes do not match.
    (model_dir / "chat_template.jinja").write_text(
        "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
        "{%- if m['role'] == 'assistant' and loop.last %}<think></think>{% endif -%}"
        "{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
    )
    with pytest.raises(InvalidRequest, match="Qwen3_5Template"):
        Template(model_id=str(model_dir)).encode(CONVERSATION)
    assert Qwen3_5Template(model_id=str(model_dir)).encode(CONVERSATION)["input_ids"].size > 0


def test_an_unknown_template_name_lists_the_valid_ones(tiny_model_dir: Path) -> None:
    with pytest.raises(InvalidRequest) as raised:
        get_template("Qwen9Template", model_id=str(tiny_model_dir))
    assert "Qwen3_5Template" in str(raised.value) and "Template" in template_names()


def test_a_missing_model_directory_is_refused_with_the_accepted_forms(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="ms://"):
        Template(model_id=str(tmp_path / "nowhere"))


def test_hub_model_ids_fail_clearly_when_the_hub_cannot_be_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def unreachable(repo_id: str) -> str:
        raise ConnectionError(f"cannot reach the hub for {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(InvalidRequest, match=r"Could not load model hf://Qwen/Qwen3-0\.6B") as raised:
        Template(model_id="hf://Qwen/Qwen3-0.6B")
    assert "local path" in str(raised.value)
    monkeypatch.setitem(__import__("sys").modules, "modelscope", None)  # as if it were not installed
    with pytest.raises(InvalidRequest, match="needs the modelscope package"):
        Template(model_id="ms://Qwen/Qwen3.5-4B")


def test_qwen_wraps_consecutive_tool_results_in_one_user_turn(qwen_template: Template) -> None:
    trajectory = Trajectory(
        messages=[
            Message("user", "Weather in Paris and Rome?"),
            Message("assistant", "Checking both."),
            Message("tool", "Paris: sun"),
            Message("tool", "Rome: rain"),
            Message("assistant", "Sun in Paris, rain in Rome."),
        ]
    )
    feature = qwen_template.encode(trajectory)
    assert qwen_template.decode(feature["input_ids"], skip_special_tokens=False) == (
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\nChecking both.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nParis: sun\n</tool_response>\n<tool_response>\nRome: rain\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\nSun in Paris, rain in Rome.<|im_end|>\n"
    )
    assert trained_spans(qwen_template, feature["input_ids"], feature["labels"]) == [
        "Checking both.<|im_end|>",
        "Sun in Paris, rain in Rome.<|im_end|>",
    ]
