"""The cookbook's server configs validate as shipped and default to the tiny local models (offline)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from twinkle.config import load_config
from twinkle.server.cli import main

SERVER_DIR = Path(__file__).resolve().parents[2] / "cookbook" / "client" / "server"
CONFIGS = sorted(SERVER_DIR.glob("*/*.yaml"))
SETTINGS = (
    "TWINKLE_MODEL_DIR",
    "TWINKLE_VL_MODEL_DIR",
    "TWINKLE_SERVED_NAME",
    "TWINKLE_PORT",
    "TWINKLE_HOST",
)


@pytest.fixture(autouse=True)
def defaults_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)


def test_every_documented_config_file_exists() -> None:
    names = {str(path.relative_to(SERVER_DIR)) for path in CONFIGS}
    assert names == {
        "megatron/server_config.yaml",
        "megatron/server_config_4b.yaml",
        "mock/server_config.yaml",
        "transformer/server_config.yaml",
        "transformer/server_config_e2e.yaml",
    }


@pytest.fixture
def built_models(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding ./models/tiny-{qwen,vl}, as run.sh builds them, as the current directory."""
    (tmp_path / "models").mkdir()
    for name in ("tiny-qwen", "tiny-vl"):  # check-config looks for a model directory, not inside it
        (tmp_path / "models" / name).symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("path", CONFIGS, ids=[str(path.relative_to(SERVER_DIR)) for path in CONFIGS])
def test_check_config_accepts_the_file_even_without_megatron_or_a_gpu(path: Path, built_models: Path) -> None:
    assert main(["check-config", "-c", str(path)]) == 0


def test_check_config_says_how_to_build_the_tiny_model_before_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    assert main(["check-config", "-c", str(SERVER_DIR / "mock" / "server_config.yaml")]) == 2
    assert "twinkle-server build-tiny-model ./models/tiny-qwen" in capsys.readouterr().err


@pytest.mark.parametrize("path", CONFIGS, ids=[str(path.relative_to(SERVER_DIR)) for path in CONFIGS])
def test_the_default_models_are_the_tiny_local_ones(path: Path) -> None:
    config = load_config(str(path))
    model_ids = {app.args.model_id for app in config.model_apps()} | {
        app.args.model_id for app in config.sampler_apps()
    }
    assert model_ids and all(model_id.startswith("./models/tiny-") for model_id in model_ids), model_ids


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", sorted(SERVER_DIR.glob("*/run.sh")), ids=lambda path: path.parent.name)
def test_the_launch_script_is_valid_bash(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
