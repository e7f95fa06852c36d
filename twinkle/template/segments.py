"""A rendered conversation as text segments, each either trained on or masked out of the loss."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from twinkle.data_format import IMAGE_MARKER, Message
from twinkle.errors import InvalidRequest


@dataclass(frozen=True)
class Segment:
    """Rendered text; `trainable` segments get labels, the others -100. `images` fill its image slots."""

    text: str
    trainable: bool
    images: tuple[str, ...] = ()


def merge_segments(segments: Iterable[Segment]) -> list[Segment]:
    """Neighbours with the same trainability joined, so each span is tokenized as one piece of text."""
    merged: list[Segment] = []
    for segment in segments:
        if not segment.text:
            continue
        if merged and merged[-1].trainable == segment.trainable:
            last = merged[-1]
            merged[-1] = Segment(last.text + segment.text, last.trainable, last.images + segment.images)
        else:
            merged.append(segment)
    return merged


def content_pieces(message: Message) -> list[str | None]:
    """The message text split at its images: strings for text, None for each image, in order.

    Images go where the text says `<image>`; images the text does not mark go before it, as the hub
    datasets (and most chat templates) expect.
    """
    images = message.images or []
    parts = message.content.split(IMAGE_MARKER)
    markers = len(parts) - 1
    if markers > len(images):
        raise InvalidRequest(
            f"A {message.role} message marks {markers} images with {IMAGE_MARKER} but carries {len(images)}.",
            hint=f"Attach one image per {IMAGE_MARKER} marker (Message(..., images=[...])).",
        )
    pieces: list[str | None] = [None] * (len(images) - markers)
    for index, part in enumerate(parts):
        if index:
            pieces.append(None)
        if part:
            pieces.append(part)
    return pieces


def assign_images(segments: list[Segment], images: list[str], image_token: str) -> list[Segment]:
    """Each image handed to the segment whose text holds its placeholder token, in order."""
    slots = sum(segment.text.count(image_token) for segment in segments)
    if slots != len(images):
        raise InvalidRequest(
            f"The rendered conversation has {slots} image slots ({image_token}) for {len(images)} images.",
            hint="Use a template for this model family, or check that the model reads images.",
        )
    assigned: list[Segment] = []
    remaining = list(images)
    for segment in segments:
        count = segment.text.count(image_token)
        taken, remaining = remaining[:count], remaining[count:]
        assigned.append(Segment(segment.text, segment.trainable, tuple(taken)))
    return assigned
