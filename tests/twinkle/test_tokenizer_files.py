"""Which files make a served model's tokenizer, and which names count as hub-style."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle.tokenizer_files import is_hub_style_name, list_tokenizer_files, tokenizer_directory


@pytest.mark.parametrize("name", ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B"])
def test_org_slash_name_is_hub_style(name: str) -> None:
    assert is_hub_style_name(name)


@pytest.mark.parametrize("name", ["tiny-qwen", "/models/qwen", "hf://Qwen/Qwen3-8B", "a/b/c", "./x/y", "/x"])
def test_paths_schemes_and_plain_names_are_not_hub_style(name: str) -> None:
    assert not is_hub_style_name(name)


def test_a_local_model_directory_lists_its_tokenizer_files_and_never_its_weights(tiny_model_dir: Path) -> None:
    directory = tokenizer_directory(str(tiny_model_dir))
    assert directory == tiny_model_dir
    files = {f.name: f for f in list_tokenizer_files(directory)}
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert not [name for name in files if name.endswith((".safetensors", ".bin"))]
    assert files["tokenizer.json"].size == (tiny_model_dir / "tokenizer.json").stat().st_size
    assert len(files["tokenizer.json"].sha256) == 64


def test_a_directory_with_only_a_config_or_nothing_cached_has_no_tokenizer(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert tokenizer_directory(str(tmp_path)) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert tokenizer_directory("hf://nobody/nothing-cached") is None
