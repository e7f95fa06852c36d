"""Fixtures for the torch backends: TransformersBackend instances over the session's tiny Qwen model.

TWINKLE_TEST_DEVICE picks the device (default cpu); float32 everywhere so results compare exactly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # torch loads lazily: the mock backend's tests in this folder must not pay for it
    from twinkle.backends.transformers_backend import TransformersBackend

TEST_DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")

BackendFactory = Callable[..., "TransformersBackend"]


@pytest.fixture
def make_backend(tiny_model_dir: Path) -> BackendFactory:
    """Builds backends over the tiny model; keyword arguments go to TransformersBackend."""
    import torch

    from twinkle.backends.transformers_backend import TransformersBackend

    # Tiny matrices run fastest on one thread, and the test box's two cores are shared with other jobs:
    # with two threads each small matmul waits on the other thread and a training step slows down 20x.
    torch.set_num_threads(1)

    def make(**options: object) -> TransformersBackend:
        options.setdefault("torch_dtype", "float32")
        options.setdefault("device", TEST_DEVICE)
        return TransformersBackend(str(tiny_model_dir), **options)  # type: ignore[arg-type]

    return make


@pytest.fixture
def backend(make_backend: BackendFactory) -> TransformersBackend:
    return make_backend()
