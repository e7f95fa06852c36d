"""Opening the images a trajectory refers to, for a model's image processor."""

from __future__ import annotations

import io
from typing import Any

from twinkle.data_format import image_bytes
from twinkle.errors import InvalidRequest


def open_image(ref: str) -> Any:
    """A Pillow RGB image from a `data:` URI or a file path."""
    try:
        from PIL import Image
    except ImportError as missing:
        raise InvalidRequest("Images need the Pillow package.", hint="pip install pillow") from missing
    data = image_bytes(ref)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except OSError as error:
        raise InvalidRequest(
            f"Cannot decode image {ref[:80]!r}: {error}", hint="Use a PNG or JPEG image."
        ) from None
