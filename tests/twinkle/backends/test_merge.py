"""Merging a PEFT LoRA into the base weights (twinkle.backends.hf.merge) on the tiny model: the merged directory
loads with plain transformers and gives the adapter's logprobs, also with LoRA on a tied output head, with
rslora scaling and in bfloat16; a merge that writes through tied embeddings is what the check catches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from twinkle.backends.hf import merge
from twinkle.merged_export import max_abs_diff, probe_rows

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its output head tied to the input embeddings (as Qwen3-0.6B, Gemma, Llama-3.2-1B)."""
    directory = tmp_path_factory.mktemp("tied") / "tiny-tied"
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copyfile(tiny_model_dir / name, directory / name)
    return directory


def trained_adapter(base_dir: Path, out: Path, *, targets: list[str], rank: int = 8, alpha: float = 16,
                    rslora: bool = False) -> Path:
    """A PEFT adapter with random (non-zero) A and B, as training leaves them, saved as the server saves it."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                        use_rslora=rslora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = get_peft_model(base, config)
    model.save_pretrained(out, save_embedding_layers=False)
    return out


def peft_logprobs(base_dir: Path, adapter_dir: Path, rows: list[list[int]]) -> list[np.ndarray]:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return merge.logprobs(PeftModel.from_pretrained(base, str(adapter_dir)).eval(), rows)


def test_a_merged_model_loads_with_plain_transformers_and_gives_the_adapters_logprobs(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = trained_adapter(tiny_model_dir, tmp_path / "adapter", targets=[*ALL_LINEAR, "lm_head"])
    rows = probe_rows(512)
    out = tmp_path / "merged"
    out.mkdir()
    result = merge.export_merged(tiny_model_dir, adapter, out, rows, max_shard_size="200KB")

    names = set(result.files)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    assert result.shards == len([n for n in names if n.endswith(".safetensors")]) > 1  # sharded at 200KB
    assert result.dtype == "float32" and result.size_bytes == sum((out / n).stat().st_size for n in names)

    model = AutoModelForCausalLM.from_pretrained(out)  # what a user runs: no PEFT, no Twinkle
    assert AutoTokenizer.from_pretrained(out)("twinkle")["input_ids"]
    expected = peft_logprobs(tiny_model_dir, adapter, rows)
    assert max_abs_diff(merge.logprobs(model.eval(), rows), expected) < 1e-4
    assert max_abs_diff(result.merged_logprobs, expected) < 1e-4
    assert max_abs_diff(result.adapter_logprobs, expected) == 0.0
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert max_abs_diff(merge.logprobs(plain, rows), expected) > 1e-2  # the LoRA changed the answer


def test_a_lora_on_a_tied_output_head_is_merged_into_its_own_copy_and_the_embeddings_stay_the_bases(
        tied_model_dir: Path, tmp_path: Path) -> None:
    adapter = trained_adapter(tied_model_dir, tmp_path / "adapter", targets=["q_proj", "v_proj", "lm_head"])
    rows = probe_rows(512)
    out = tmp_path / "merged"
    out.mkdir()
    result = merge.export_merged(tied_model_dir, adapter, out, rows)

    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tied_model_dir)
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert not torch.equal(model.get_output_embeddings().weight, base.get_output_embeddings().weight)
    expected = peft_logprobs(tied_model_dir, adapter, rows)
    assert max_abs_diff(merge.logprobs(model.eval(), rows), expected) < 1e-4
    assert max_abs_diff(result.merged_logprobs, expected) < 1e-4


def test_a_merge_that_writes_through_tied_embeddings_differs_by_far_more_than_the_tolerance(
        tied_model_dir: Path, tmp_path: Path) -> None:
    adapter = trained_adapter(tied_model_dir, tmp_path / "adapter", targets=["q_proj", "lm_head"])
    rows = probe_rows(512)
    out = tmp_path / "merged"
    out.mkdir()
    result = merge.export_merged(tied_model_dir, adapter, out, rows, merge=lambda peft: peft.merge_and_unload())
    assert max_abs_diff(result.merged_logprobs, result.adapter_logprobs) > 0.1


def test_rslora_scaling_survives_the_merge(tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = trained_adapter(tiny_model_dir, tmp_path / "adapter", targets=ALL_LINEAR, rank=16, alpha=8,
                              rslora=True)
    rows = probe_rows(512)
    out = tmp_path / "merged"
    out.mkdir()
    result = merge.export_merged(tiny_model_dir, adapter, out, rows)
    assert max_abs_diff(result.merged_logprobs, result.adapter_logprobs) < 1e-4


def test_a_bfloat16_export_stores_bfloat16_weights_within_the_16bit_tolerance(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = trained_adapter(tiny_model_dir, tmp_path / "adapter", targets=ALL_LINEAR)
    rows = probe_rows(512)
    out = tmp_path / "merged"
    out.mkdir()
    result = merge.export_merged(tiny_model_dir, adapter, out, rows, dtype="bfloat16")
    assert result.dtype == "bfloat16" and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert 0 < max_abs_diff(result.merged_logprobs, result.adapter_logprobs) < 0.1
