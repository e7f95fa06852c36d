"""The shapes data takes on its way to a model: Message and Trajectory (a conversation), InputFeature (tokens).

Messages and trajectories are pydantic models that `model_dump(mode="json")` into plain JSON, so they can be
sent to a server as they are. That is why images are stored as strings: a file path, or a `data:` URI
holding the encoded image; bytes, Pillow images and `{"bytes", "path"}` dicts (the hub's image columns)
are turned into such strings on construction.

An InputFeature is one tokenized trajectory: numpy int64 `input_ids`, `labels` (-100 where no loss is
taken) and `attention_mask`, the processor's vision arrays when the trajectory holds images, and the
trajectory's `extra` passed through untouched (ground truth for rewards, DPO roles, ids).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NotRequired, Required, TypedDict, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from twinkle.errors import InvalidRequest

IGNORE_INDEX = -100
"""The label of a token that takes no loss (prompt, padding, image placeholders)."""

IMAGE_MARKER = "<image>"
"""Where in a message's text its images go; images without a marker go before the text."""

Role = Literal["system", "user", "assistant", "tool"]
TrajectoryFormat = Literal["chat", "completion"]

_IMAGE_MIME_BY_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))


class Message(BaseModel):
    """One turn of a conversation. `Message('user', 'hi')` and `Message(role='user', content='hi')` agree."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str = ""
    images: list[str] | None = None

    def __init__(self, role: Role | None = None, content: str | None = None, images: Any = None, **data: Any):
        if role is not None:
            data["role"] = role
        if content is not None:
            data["content"] = content
        if images is not None:
            data["images"] = images
        super().__init__(**data)

    @field_validator("images", mode="before")
    @classmethod
    def _images_as_strings(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str | bytes | Path | Mapping) or hasattr(value, "save"):
            value = [value]
        return [image_ref(image) for image in value]


class Trajectory(BaseModel):
    """A conversation plus anything the training code needs alongside it.

    `format="chat"` renders the messages with the model's chat template. `format="completion"` joins the
    message texts as they are, with no template and no end token; the loss then falls on the assistant
    texts (prompt/completion data such as the Pig Latin pairs).
    """

    model_config = ConfigDict(extra="forbid")

    messages: list[Message]
    extra: dict[str, Any] = Field(default_factory=dict)
    format: TrajectoryFormat = "chat"

    def __init__(
        self,
        messages: list[Message] | list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        **data: Any,
    ):
        if messages is not None:
            data["messages"] = messages
        if extra is not None:
            data["extra"] = extra
        super().__init__(**data)

    @field_validator("extra")
    @classmethod
    def _extra_is_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(value)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"extra must hold JSON values only so it can travel to a server: {error}"
            ) from None
        return value


class InputFeature(TypedDict, total=False):
    """One encoded trajectory. A plain dict at run time; vision models may add more processor arrays."""

    input_ids: Required[np.ndarray]  # int64 [T]
    labels: Required[np.ndarray]  # int64 [T], IGNORE_INDEX where no loss is taken
    attention_mask: Required[np.ndarray]  # int64 [T]
    pixel_values: NotRequired[np.ndarray]
    image_grid_thw: NotRequired[np.ndarray]
    images: NotRequired[list[str]]
    extra: NotRequired[dict[str, Any]]


TOKEN_KEYS = ("input_ids", "labels", "attention_mask")


def as_trajectory(value: Trajectory | Mapping[str, Any]) -> Trajectory:
    """A Trajectory from itself or from its dict form (a dataset row, a JSON body)."""
    if isinstance(value, Trajectory):
        return value
    try:
        return Trajectory.model_validate(dict(value))
    except ValueError as error:
        raise InvalidRequest(
            f"Not a trajectory: {error}",
            hint="Pass Trajectory(messages=[Message(role=..., content=...), ...]), or map a preprocessor first.",
        ) from None


def image_ref(image: Any) -> str:
    """The string form of an image: paths stay paths, anything holding bytes becomes a `data:` URI."""
    if isinstance(image, str):
        return image
    if isinstance(image, Path):
        return str(image)
    if isinstance(image, bytes | bytearray):
        return _data_uri(bytes(image))
    if isinstance(image, Mapping):
        if image.get("bytes"):
            return _data_uri(bytes(image["bytes"]))
        if image.get("path"):
            return str(image["path"])
    if hasattr(image, "save"):  # a Pillow image; Pillow itself is only needed by whoever made it
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return _data_uri(buffer.getvalue())
    raise InvalidRequest(
        f"Cannot use a {type(image).__name__} as an image.",
        hint="Pass a file path, a data: URI, encoded image bytes or a Pillow image.",
    )


def image_bytes(ref: str) -> bytes:
    """The encoded bytes of an image given as a `data:` URI or a file path."""
    if ref.startswith("data:"):
        _, _, payload = ref.partition(",")
        return base64.b64decode(payload)
    path = Path(ref).expanduser()
    if not path.is_file():
        raise InvalidRequest(
            f"Image {ref[:200]!r} is neither a data: URI nor an existing file.",
            hint="Use an absolute path, or embed the image as bytes.",
        )
    return path.read_bytes()


def _data_uri(data: bytes) -> str:
    mime = next((mime for magic, mime in _IMAGE_MIME_BY_MAGIC if data.startswith(magic)), "image/png")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def input_feature_to_row(feature: InputFeature) -> dict[str, Any]:
    """The JSON form of an InputFeature: token arrays as int lists, other arrays as base64 `.npy` strings."""
    row: dict[str, Any] = {}
    for key, value in feature.items():
        if key in TOKEN_KEYS:
            row[key] = np.asarray(value, dtype=np.int64).tolist()
        elif isinstance(value, np.ndarray):
            row[key] = {"npy": _array_to_base64(value)}
        else:
            row[key] = value
    return row


def input_feature_from_row(row: Mapping[str, Any]) -> InputFeature:
    """The inverse of input_feature_to_row."""
    missing = [key for key in TOKEN_KEYS if key not in row]
    if missing:
        raise InvalidRequest(
            f"Not an encoded row: it lacks {', '.join(missing)}.", hint="Encode the data first."
        )
    feature: dict[str, Any] = {}
    for key, value in row.items():
        if key in TOKEN_KEYS:
            feature[key] = np.asarray(value, dtype=np.int64)
        elif isinstance(value, Mapping) and set(value) == {"npy"}:
            feature[key] = _array_from_base64(value["npy"])
        else:
            feature[key] = value
    return cast(InputFeature, feature)


def _array_to_base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _array_from_base64(text: str) -> np.ndarray:
    return np.asarray(np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False))
