"""Template: turns trajectories into token ids and loss labels with a model's own tokenizer and chat template.

The loss falls on what the assistant says and on the token that ends its turn, nothing else: system and
user turns, role headers, the newline after each turn and image placeholders are labelled -100.

To know where each assistant turn starts and ends, the conversation is rendered once per assistant turn,
up to the turn with a generation prompt and through the turn without one; the difference is the turn.
This needs a chat template that renders conversations incrementally (each prefix renders as a prefix of
the whole), which ChatML templates do; model families whose templates do not (they rewrite earlier turns,
like Qwen3's thinking blocks) get a subclass that builds the segments itself (see Qwen3_5Template).

Each segment is tokenized on its own. Turns are separated by special tokens, which the tokenizer never
merges with their neighbours, so this gives the same ids as tokenizing the whole text at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast, get_args

import numpy as np

from twinkle.data_format import IGNORE_INDEX, InputFeature, Message, Trajectory, as_trajectory
from twinkle.errors import InvalidRequest
from twinkle.template.hub import model_directory
from twinkle.template.images import open_image
from twinkle.template.segments import Segment, assign_images, content_pieces, merge_segments

Truncation = Literal["right", "left", "error"]
TEXT_KEYS = ("input_ids", "attention_mask")


class Template:
    """Encodes trajectories for one model. `model_id` is a local directory, `ms://org/name` or `hf://org/name`.

    `max_length` caps the tokens of an encoded trajectory; `truncation` says which end is cut
    (`right` keeps the start, `left` keeps the end, `error` refuses).
    """

    def __init__(
        self,
        model_id: str | Path,
        max_length: int | None = None,
        truncation: Truncation = "right",
        trust_remote_code: bool = False,
    ) -> None:
        if truncation not in get_args(Truncation):
            raise InvalidRequest(
                f"Unknown truncation {truncation!r}.", hint=f"Use one of {', '.join(get_args(Truncation))}."
            )
        if max_length is not None and max_length < 1:
            raise InvalidRequest(f"max_length must be positive, got {max_length}.", hint="Or pass None.")
        self.model_id = str(model_id)
        self.model_dir = model_directory(model_id)
        self.max_length = max_length
        self.truncation: Truncation = truncation
        self.trust_remote_code = trust_remote_code
        self.tokenizer = self._load_tokenizer()
        self._processor: Any = None
        self._special_tokens = self._special_token_strings()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_id={self.model_id!r}, max_length={self.max_length})"

    # Encoding and decoding.

    def encode(
        self, trajectory: Trajectory | Mapping[str, Any], add_generation_prompt: bool = False
    ) -> InputFeature:
        """Token ids, labels (-100 outside assistant turns) and attention mask of one trajectory.

        `add_generation_prompt` appends the header of an assistant turn, for prompts that a sampler completes.
        """
        trajectory = as_trajectory(trajectory)
        if trajectory.format == "completion":
            segments = self.render_completion(trajectory.messages)
        else:
            segments = self.render(trajectory.messages, add_generation_prompt)
        images = [image for message in trajectory.messages for image in message.images or []]
        if images:
            segments = assign_images(segments, images, self.image_token)
        feature = self._tokenize(merge_segments(segments))
        if images:
            feature["images"] = images
        feature["extra"] = dict(trajectory.extra)
        return self._truncate(feature)

    def batch_encode(
        self, trajectories: Iterable[Trajectory | Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> list[InputFeature]:
        return [self.encode(trajectory, add_generation_prompt) for trajectory in trajectories]

    def decode(self, token_ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; -100 entries are skipped, so label arrays decode to what is trained on."""
        ids = [int(token) for token in token_ids if int(token) != IGNORE_INDEX]
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    @property
    def eos_token_id(self) -> int | None:
        return cast(int | None, self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int | None:
        pad = self.tokenizer.pad_token_id
        return cast(int | None, pad if pad is not None else self.tokenizer.eos_token_id)

    # Rendering; subclasses for model families override `render`.

    def render(self, messages: list[Message], add_generation_prompt: bool) -> list[Segment]:
        """The conversation as segments, found by rendering it incrementally with the chat template."""
        conversation = [self._message_for_chat_template(message) for message in messages]
        full = self._apply_chat_template(conversation, add_generation_prompt)
        segments: list[Segment] = []
        cursor = 0
        for index, message in enumerate(messages):
            if message.role != "assistant":
                continue
            before = self._apply_chat_template(conversation[:index], True) if index else ""
            after = self._apply_chat_template(conversation[: index + 1], False)
            if not (full.startswith(after) and after.startswith(before) and len(before) >= cursor):
                raise InvalidRequest(
                    f"The chat template of {self.model_id} does not render conversations incrementally, "
                    "so the assistant turns cannot be located.",
                    hint="Use the template class for this model family, e.g. Qwen3_5Template for Qwen models.",
                )
            segments.append(Segment(full[cursor : len(before)], False))
            segments.extend(self._split_turn(after[len(before) :], message.content))
            cursor = len(after)
        segments.append(Segment(full[cursor:], False))
        return segments

    def render_completion(self, messages: list[Message]) -> list[Segment]:
        """Message texts joined as they are: assistant texts are trained on, and no end token is added."""
        if any(message.images for message in messages):
            raise InvalidRequest(
                "Completion-format trajectories cannot carry images.", hint="Use format='chat' for images."
            )
        return [Segment(message.content, message.role == "assistant") for message in messages]

    @property
    def image_token(self) -> str:
        """The token a model's processor expands into one slot per image patch."""
        token = getattr(self.processor, "image_token", None)
        if not isinstance(token, str):
            raise InvalidRequest(f"The processor of {self.model_id} names no image token.")
        return token

    @property
    def processor(self) -> Any:
        """The model's multi-modal processor, loaded the first time an image needs it."""
        if self._processor is None:
            from transformers import AutoProcessor

            try:
                processor = AutoProcessor.from_pretrained(
                    self.model_dir, trust_remote_code=self.trust_remote_code
                )
            except (OSError, ValueError) as error:
                raise InvalidRequest(
                    f"{self.model_id} has no processor for images ({error}).",
                    hint="Use a vision-language model.",
                ) from None
            if getattr(processor, "image_processor", None) is None:
                raise InvalidRequest(
                    f"{self.model_id} reads text only, but the trajectory has images.",
                    hint="Use a vision-language model, or drop the images.",
                )
            self._processor = processor
        return self._processor

    # Internals.

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as error:
            raise InvalidRequest(
                f"Cannot load a tokenizer from {self.model_dir}: {error}", hint="Pass a model directory."
            ) from None

    def _message_for_chat_template(self, message: Message) -> dict[str, Any]:
        if not message.images:
            return {"role": message.role, "content": message.content}
        parts = [
            {"type": "image"} if piece is None else {"type": "text", "text": piece}
            for piece in content_pieces(message)
        ]
        return {"role": message.role, "content": parts}

    def _apply_chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if not self.tokenizer.chat_template:
            raise InvalidRequest(
                f"The tokenizer of {self.model_id} has no chat template.",
                hint="Use a template class for this model family, or completion-format trajectories.",
            )
        rendered = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(rendered)

    def _split_turn(self, turn: str, content: str) -> list[Segment]:
        """An assistant turn as rendered: header masked, content plus the end-of-turn token trained, rest masked."""
        start = turn.find(content)
        if start < 0:  # the template rewrote the content: train on the whole turn as rendered
            return [Segment(turn, True)]
        rest = turn[start + len(content) :]
        end = self._leading_special_token(rest)
        return [
            Segment(turn[:start], False),
            Segment(content + end, True),
            Segment(rest[len(end) :], False),
        ]

    def _special_token_strings(self) -> list[str]:
        """Special and added tokens, longest first (so a prefix match finds the whole token)."""
        specials = {str(token) for token in self.tokenizer.all_special_tokens}
        specials |= {str(token) for token in self.tokenizer.get_added_vocab()}
        return sorted((token for token in specials if token), key=len, reverse=True)

    def _leading_special_token(self, text: str) -> str:
        return next((token for token in self._special_tokens if text.startswith(token)), "")

    def _tokenize(self, segments: list[Segment]) -> InputFeature:
        input_ids: list[int] = []
        labels: list[int] = []
        vision: dict[str, list[np.ndarray]] = {}
        for segment in segments:
            if segment.images:
                encoded = self.processor(
                    text=segment.text,
                    images=[open_image(ref) for ref in segment.images],
                    add_special_tokens=False,
                    return_tensors="np",
                )
                ids = [int(token) for token in encoded["input_ids"][0]]
                for key, value in encoded.items():
                    if key not in TEXT_KEYS:
                        vision.setdefault(key, []).append(np.asarray(value))
            else:
                ids = list(self.tokenizer(segment.text, add_special_tokens=False)["input_ids"])
            input_ids.extend(ids)
            labels.extend(ids if segment.trainable else [IGNORE_INDEX] * len(ids))
        ids_array = np.asarray(input_ids, dtype=np.int64)
        labels_array = np.asarray(labels, dtype=np.int64)
        feature: dict[str, Any] = {
            "input_ids": ids_array,
            "labels": labels_array,
            "attention_mask": np.ones_like(ids_array),
        }
        if vision:
            labels_array[ids_array == self._image_token_id()] = IGNORE_INDEX
            feature.update({key: np.concatenate(values) for key, values in vision.items()})
        return cast(InputFeature, feature)

    def _image_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.image_token))

    def _truncate(self, feature: InputFeature) -> InputFeature:
        length = len(feature["input_ids"])
        if self.max_length is None or length <= self.max_length:
            return feature
        if self.truncation == "error":
            raise InvalidRequest(
                f"A trajectory encodes to {length} tokens, over max_length={self.max_length}.",
                hint="Raise max_length, shorten the data, or pass truncation='right' or 'left'.",
            )
        kept = (
            slice(0, self.max_length)
            if self.truncation == "right"
            else slice(length - self.max_length, length)
        )
        if "images" in feature:
            image_slots = feature["input_ids"] == self._image_token_id()
            if image_slots.sum() != image_slots[kept].sum():
                raise InvalidRequest(
                    f"Truncating to max_length={self.max_length} would cut an image out of a trajectory.",
                    hint="Raise max_length for multi-modal data.",
                )
        for key in ("input_ids", "labels", "attention_mask"):
            feature[key] = feature[key][kept]  # type: ignore[literal-required]
        return feature
