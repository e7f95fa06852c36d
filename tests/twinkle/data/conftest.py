"""Fixtures for the local data library: the shipped cookbook data and tiny text and vision models.

The datasets library caches loaded and mapped tables; the tests keep that cache in a temporary folder
(set before the library is imported) rather than in the user's home.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_CACHE = tempfile.mkdtemp(prefix="twinkle-test-hf-datasets-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("HF_DATASETS_CACHE", _CACHE)

import datasets  # noqa: E402 - after the cache location is set

from twinkle.template import Qwen3_5Template, Template  # noqa: E402
from twinkle.tiny_model import ensure_tiny_model  # noqa: E402

datasets.disable_progress_bars()

DATA_DIR = Path(__file__).resolve().parents[3] / "cookbook" / "data"


@pytest.fixture(scope="session")
def tiny_vision_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA-style model (Qwen3 text model + SigLIP tower) whose processor expands each image to 16 tokens."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-vision", vision=True)


@pytest.fixture(scope="session")
def qwen_template(tiny_model_dir: Path) -> Qwen3_5Template:
    return Qwen3_5Template(model_id=str(tiny_model_dir))


@pytest.fixture(scope="session")
def chat_template(tiny_model_dir: Path) -> Template:
    """The generic template, which follows the tiny model's own ChatML chat template."""
    return Template(model_id=str(tiny_model_dir))
