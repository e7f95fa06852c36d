from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from twinkle.data_format import (
    Message,
    Trajectory,
    as_trajectory,
    image_bytes,
    input_feature_from_row,
    input_feature_to_row,
)
from twinkle.errors import InvalidRequest


def test_messages_take_their_fields_by_position_or_by_name() -> None:
    assert Message("user", "hi") == Message(role="user", content="hi")
    assert Trajectory([Message("user", "hi")], {"id": 1}) == Trajectory(
        messages=[Message(role="user", content="hi")], extra={"id": 1}
    )


def test_a_trajectory_dumps_to_json_and_validates_back_unchanged() -> None:
    trajectory = Trajectory(
        messages=[
            Message("user", "<image>What is this?", images=[b"\x89PNG fake"]),
            Message("assistant", "A dot."),
        ],
        extra={"ground_truth": "42"},
    )
    dumped = json.loads(json.dumps(trajectory.model_dump(mode="json")))
    assert as_trajectory(dumped) == trajectory


def test_images_given_as_bytes_or_pillow_images_become_data_uris_that_decode_to_the_same_image() -> None:
    picture = Image.new("RGB", (4, 3), "red")
    message = Message("user", "look", images=picture)
    ref = message.images[0]  # type: ignore[index]
    assert ref.startswith("data:image/png;base64,")
    assert Message("user", "look", images=[image_bytes(ref)]).images == [ref]


def test_extra_values_that_cannot_be_json_are_refused() -> None:
    with pytest.raises(ValueError, match="JSON"):
        Trajectory(messages=[Message("user", "hi")], extra={"array": np.zeros(2)})


def test_something_that_is_not_a_trajectory_is_refused_with_a_hint() -> None:
    with pytest.raises(InvalidRequest, match="preprocessor"):
        as_trajectory({"query": "hi", "response": "hello"})


def test_an_input_feature_survives_its_json_row_form_including_vision_arrays() -> None:
    feature = {
        "input_ids": np.array([1, 2, 3], dtype=np.int64),
        "labels": np.array([-100, 2, 3], dtype=np.int64),
        "attention_mask": np.ones(3, dtype=np.int64),
        "pixel_values": np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2),
        "extra": {"ground_truth": "7"},
    }
    row = json.loads(json.dumps(input_feature_to_row(feature)))  # type: ignore[arg-type]
    restored = input_feature_from_row(row)
    assert set(restored) == set(feature)
    for key in ("input_ids", "labels", "attention_mask", "pixel_values"):
        assert restored[key].dtype == feature[key].dtype  # type: ignore[literal-required, attr-defined]
        np.testing.assert_array_equal(restored[key], feature[key])  # type: ignore[literal-required]
    assert restored["extra"] == {"ground_truth": "7"}
