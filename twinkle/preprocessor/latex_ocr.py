"""LaTeX-OCR rows (`image`, `text`): an image of a formula to transcribe into LaTeX."""

from __future__ import annotations

from twinkle.data_format import IMAGE_MARKER, Message, Trajectory, image_bytes, image_ref
from twinkle.preprocessor.base import Preprocessor, ProcessorOutput, Row, column, register_preprocessor

DEFAULT_PROMPT = f"{IMAGE_MARKER}Using LaTeX to perform OCR on the image."


@register_preprocessor
class LatexOCRProcessor(Preprocessor):
    """user (the prompt, with the image attached) + assistant (`text`).

    The image may be a path, bytes, a hub image column or a Pillow image. With `embed_images` (the default)
    the trajectory carries the image itself as a data: URI, so it stays valid on another machine (a server
    encoding it); otherwise file paths stay paths.
    """

    def __init__(self, prompt: str = DEFAULT_PROMPT, embed_images: bool = True) -> None:
        self.prompt = prompt
        self.embed_images = embed_images

    def __call__(self, row: Row | Trajectory) -> ProcessorOutput:
        image = image_ref(column(row, "image", "LatexOCRProcessor"))
        if self.embed_images and not image.startswith("data:"):
            image = image_ref(image_bytes(image))
        text = str(column(row, "text", "LatexOCRProcessor"))
        return Trajectory(messages=[Message("user", self.prompt, images=[image]), Message("assistant", text)])
