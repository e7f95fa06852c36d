"""How a vision-language model reads images: image chunks and vision arrays turned into model inputs.

Images reach the backend in two shapes, and both end as a token sequence in which every image occupies a run
of the model's image token (one per image feature), plus the processor's arrays (pixel_values, ...):

    Tinker    an ImageChunk (png/jpeg bytes) between TextChunks. It is decoded and run through the model's
              image processor here; the chunk becomes N image tokens, N being the number the processor
              expands it into. A client-side `expected_tokens` must equal N: loss_fn_inputs are aligned with
              the full sequence, an image taking N positions.
    Twinkle   an InputFeature from `twinkle.template`: the image tokens are already in the text and the
              processor's arrays ride in loss_fn_inputs under their own names (`twinkle.input_feature`).

Vision arrays of a batch are concatenated along their first dimension, in datum order: the model fills the
image tokens of the flattened batch, row by row, with the features of the images in that order.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from twinkle.errors import InvalidRequest
from twinkle.types import Chunk, Datum, ImageChunk, TextChunk, token_ids

# Vision arguments of a model's forward start with these (pixel_values, image_sizes, image_grid_thw, ...).
VISION_PREFIXES = ("pixel_", "image_", "video_")
# Processor outputs that are text, not image: the backend builds these itself.
TEXT_OUTPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids"})

VisionArrays = dict[str, np.ndarray]


class ImageInputs:
    """One model's way of reading images; without a processor (a text-only model) it refuses them."""

    def __init__(
        self, model_name: str, processor: Any | None = None, forward: Any | None = None, *, vision_model: bool = False
    ) -> None:
        self.model_name = model_name
        self.processor = processor
        self.vision_model = vision_model  # has a vision tower, whether or not its processor loaded
        self.image_token: str | None = None
        self.image_token_id: int | None = None
        self.arguments: frozenset[str] = frozenset()
        if processor is not None:
            self.image_token = str(processor.image_token)
            self.image_token_id = int(processor.tokenizer.convert_tokens_to_ids(self.image_token))
            parameters = inspect.signature(forward).parameters if forward is not None else {}
            named = {name for name in parameters if name.startswith(VISION_PREFIXES)}
            self.arguments = frozenset(named | set(processor.image_processor.model_input_names))

    @property
    def enabled(self) -> bool:
        return self.processor is not None

    def datum(self, datum: Datum, where: str) -> tuple[Datum, VisionArrays]:
        """The datum with its images expanded into image tokens, and the vision arrays its forward needs.

        The returned datum holds one TextChunk and no vision arrays, so the text-only batching applies.
        """
        images = datum.images()
        vision_keys = [key for key in datum.loss_fn_inputs if self._is_vision_key(key)]
        self._refuse_unreadable(where, bool(images or vision_keys))
        if not self.enabled:
            return datum, {}
        if images and vision_keys:
            raise InvalidRequest(
                f"{where} holds ImageChunks and also vision arrays ({', '.join(vision_keys)}) in loss_fn_inputs.",
                hint="Send images either as ImageChunks or as an encoded InputFeature, not both.",
            )
        if images:
            tokens, vision = self._expand(datum.model_input, where)
        else:
            tokens = datum.tokens()
            vision = {key: np.asarray(datum.loss_fn_inputs[key]) for key in vision_keys}
            self._check_placeholders(tokens, vision, where)
            if not vision:
                return datum, {}
        loss_fn_inputs = {key: value for key, value in datum.loss_fn_inputs.items() if key not in vision_keys}
        return Datum([TextChunk(tokens)], loss_fn_inputs), vision

    def prompt(self, chunks: Sequence[Chunk], where: str) -> tuple[np.ndarray, VisionArrays]:
        """A sampling prompt's tokens, images expanded, and the vision arrays of its images."""
        has_images = any(isinstance(chunk, ImageChunk) for chunk in chunks)
        self._refuse_unreadable(where, has_images)
        if not has_images:
            return token_ids(list(chunks)), {}
        return self._expand(chunks, where)

    def batch(
        self, rows: Sequence[Mapping[str, np.ndarray]], *, device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """The forward arguments for a batch whose rows carry these vision arrays (rows without images: {})."""
        present = [row for row in rows if row]
        if not present:
            return {}
        names = set(present[0])
        if any(set(row) != names for row in present):
            variants = sorted({", ".join(sorted(row)) for row in present})
            raise InvalidRequest(
                f"The datums of one batch carry different vision arrays: {' / '.join(variants)}.",
                hint="Encode every image of a batch with the same processor.",
            )
        arguments = {}
        for name in sorted(names):
            parts = [np.asarray(row[name]) for row in present]
            if len({part.shape[1:] for part in parts}) > 1:
                raise InvalidRequest(
                    f"{name} has shapes {[list(part.shape) for part in parts]} across the batch, which do not "
                    "concatenate along the first dimension.",
                    hint="Encode every image of a batch with the same processor settings.",
                )
            tensor = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts)))
            arguments[name] = tensor.to(device, dtype if tensor.is_floating_point() else None)
        return arguments

    # Internals.

    def _is_vision_key(self, key: str) -> bool:
        return key in self.arguments or key.startswith(VISION_PREFIXES)

    def _refuse_unreadable(self, where: str, has_images: bool) -> None:
        if not has_images or self.enabled:
            return
        if self.vision_model:
            raise InvalidRequest(
                f"{where} holds images, but this server has no image processor for {self.model_name}.",
                hint="Send text only; the operator can install what the model's AutoProcessor needs.",
            )
        raise InvalidRequest(
            f"{where} holds images, but {self.model_name} reads text only.",
            hint="Send text only, or use a vision-language base model.",
        )

    def _expand(self, chunks: Sequence[Chunk], where: str) -> tuple[np.ndarray, VisionArrays]:
        assert self.image_token_id is not None
        parts: list[np.ndarray] = []
        arrays: dict[str, list[np.ndarray]] = {}
        image_index = 0
        for chunk in chunks:
            if isinstance(chunk, TextChunk):
                tokens = np.asarray(chunk.tokens, dtype=np.int64).reshape(-1)
                if np.any(tokens == self.image_token_id):
                    raise InvalidRequest(
                        f"{where} has the image placeholder token {self.image_token_id} ({self.image_token}) in "
                        "its text, next to ImageChunks.",
                        hint="Send each image as one ImageChunk; the server expands it into image tokens.",
                    )
                parts.append(tokens)
                continue
            count, encoded = self._encode(chunk, f"{where} image {image_index}")
            parts.append(np.full(count, self.image_token_id, np.int64))
            for name, value in encoded.items():
                arrays.setdefault(name, []).append(value)
            image_index += 1
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return tokens, {name: np.concatenate(values) for name, values in arrays.items()}

    def _encode(self, chunk: ImageChunk, where: str) -> tuple[int, VisionArrays]:
        """How many image tokens the image takes, and the processor's arrays for it."""
        image = _decode(chunk, where)
        encoded = self.processor(  # type: ignore[misc]
            text=self.image_token, images=[image], add_special_tokens=False, return_tensors="np"
        )
        count = int(np.count_nonzero(np.asarray(encoded["input_ids"]) == self.image_token_id))
        if chunk.expected_tokens is not None and chunk.expected_tokens != count:
            raise InvalidRequest(
                f"{where} has expected_tokens={chunk.expected_tokens}, but {self.model_name} reads this "
                f"{image.width}x{image.height} image as {count} tokens.",
                hint=f"Set expected_tokens to {count} (or leave it out) and give the image {count} positions "
                "in target_tokens, weights and the other loss_fn_inputs.",
                expected_tokens=chunk.expected_tokens,
                image_tokens=count,
            )
        arrays = {name: np.asarray(value) for name, value in encoded.items() if name not in TEXT_OUTPUTS}
        return count, {name: value for name, value in arrays.items() if name in self.arguments}

    def _check_placeholders(self, tokens: np.ndarray, vision: VisionArrays, where: str) -> None:
        """Image tokens and vision arrays come together: one without the other cannot run."""
        placeholders = int(np.count_nonzero(tokens == self.image_token_id))
        if placeholders and not vision:
            raise InvalidRequest(
                f"{where} has {placeholders} image tokens ({self.image_token}) but no pixel_values.",
                hint="Send the processor's vision arrays in loss_fn_inputs, or the images as ImageChunks.",
            )
        if vision and not placeholders:
            raise InvalidRequest(
                f"{where} carries {', '.join(sorted(vision))} but no image tokens ({self.image_token}).",
                hint="Encode the trajectory with this model's template, which expands each image into tokens.",
            )
        unknown = sorted(set(vision) - self.arguments)
        if unknown:
            raise InvalidRequest(
                f"{where} carries {', '.join(unknown)}, which {self.model_name} does not take.",
                hint=f"Its vision inputs are {', '.join(sorted(self.arguments))}.",
            )


@contextmanager
def images_checked_by_model(has_images: bool) -> Iterator[None]:
    """Report the model's own image checks (image tokens against image features) as the caller's mistake."""
    try:
        yield
    except ValueError as error:
        if not has_images:
            raise
        raise InvalidRequest(
            f"The model cannot place the batch's images: {error}",
            hint="Encode images with this model's template or processor: one image token per image feature.",
        ) from error


def _decode(chunk: ImageChunk, where: str) -> Any:
    """The chunk's image as Pillow RGB."""
    try:
        from PIL import Image
    except ImportError as missing:
        raise InvalidRequest("Images need the Pillow package on the server.", hint="pip install pillow") from missing
    try:
        with Image.open(io.BytesIO(chunk.data)) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise InvalidRequest(
            f"{where} cannot be decoded as {chunk.format}: {error}", hint="Send PNG or JPEG bytes."
        ) from None


def vision_processor(directory: Any, *, trust_remote_code: bool) -> Any | None:
    """The model's multi-modal processor, or None when it has no image processor (a text-only model)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError):
        return None
    if getattr(processor, "image_processor", None) is None or not isinstance(
        getattr(processor, "image_token", None), str
    ):
        return None
    return processor
