from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import LaunchedServer, launch
from twinkle.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen-family model with a BPE tokenizer, built once per test session."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen")


@pytest.fixture(scope="session")
def mock_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    """A launched server (API + mock model, sampler and processor pools) shared by the e2e tests."""
    server = launch(tmp_path_factory.mktemp("mock-server"), tiny_model_dir, db=11, sampler=True, processor=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def transformers_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    """The same layout on the transformers backend with a torch sampler pool (CPU, float32)."""
    server = launch(tmp_path_factory.mktemp("hf-server"), tiny_model_dir, db=14, backend="transformers",
                    sampler=True, env={"OMP_NUM_THREADS": "1"})
    yield server
    server.stop()
