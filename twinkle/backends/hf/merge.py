"""Merge a PEFT LoRA adapter into a fresh copy of the base weights and write a Hugging Face model directory.

The merge runs on the CPU in float32, on a copy loaded from the base model's own files (never the pool's shared
model, which other tenants keep training on): `PeftModel.from_pretrained` loads the adapter files exactly as a
user would (which is also the adapter's check), PEFT merges each LoRA with its own scaling (alpha / rank, or
alpha / sqrt(rank) with rslora), and the result is cast to the export dtype and saved as sharded safetensors
with config.json, generation_config.json and the base model's tokenizer files. The directory is then loaded
back with `from_pretrained` for its check (twinkle.merged_export compares both with the pool).

Tied weights: when the output head shares its matrix with the input embeddings (`tie_word_embeddings`) and a
LoRA sits on either, merging in place would change both; the head gets its own copy first and the saved
config says the two are no longer tied, so the merged head is kept and the embeddings stay the base's.
"""

from __future__ import annotations

import gc
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PreTrainedModel,
)

from twinkle.backends.hf.loading import DTYPES, trust_remote_code
from twinkle.tokenizer_files import TOKENIZER_FILE_NAMES

# What a processor adds to a tokenizer (vision-language models); config.json and generation_config.json are
# written from the merged model, never copied.
PROCESSOR_FILE_NAMES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
_WRITTEN = frozenset({"config.json", "generation_config.json"})

Merge = Callable[[PeftModel], PreTrainedModel]


@dataclass
class MergedDirectory:
    """What export_merged wrote and measured."""

    adapter_logprobs: list[np.ndarray]  # the PEFT adapter files on the base model, per probe row
    merged_logprobs: list[np.ndarray]  # the merged directory loaded back, per probe row
    files: list[str]
    size_bytes: int
    shards: int
    dtype: str
    seconds: float  # merge and save, without the two checks' loads and forwards


def export_merged(base_dir: Path, adapter_dir: Path, out_dir: Path, rows: list[list[int]], *, dtype: str = "auto",
                  max_shard_size: str | int = "5GB", trust_remote_code_flag: bool | None = None,
                  merge: Merge | None = None) -> MergedDirectory:
    """Merge the adapter in `adapter_dir` into the base model of `base_dir` and write the model into `out_dir`
    (an existing empty directory); `merge` replaces the merge step (tests give it a broken one)."""
    remote = trust_remote_code(trust_remote_code_flag)
    target = export_dtype(base_dir, dtype, remote)
    with warnings.catch_warnings():  # PEFT warns about LoRA on tied weights, which merge_lora unties
        warnings.filterwarnings("ignore", message=r".*tie_word_embeddings.*")
        peft_model = PeftModel.from_pretrained(load_model(base_dir, remote), str(adapter_dir)).eval()
        adapter = logprobs(peft_model, rows)
        began = time.perf_counter()
        merged = (merge or merge_lora)(peft_model)
    del peft_model
    nn.Module.to(merged, DTYPES[target])
    merged.config.dtype = target  # type: ignore[attr-defined]
    merged.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    _write_generation_config(merged, out_dir)
    _copy_tokenizer_files(base_dir, out_dir)
    seconds = time.perf_counter() - began
    del merged
    gc.collect()
    reloaded = load_model(out_dir, remote)
    merged_logprobs = logprobs(reloaded, rows)
    del reloaded
    gc.collect()
    files = sorted(p.name for p in out_dir.iterdir() if p.is_file())
    return MergedDirectory(adapter, merged_logprobs, files, sum((out_dir / f).stat().st_size for f in files),
                           sum(f.endswith(".safetensors") for f in files), target, seconds)


def adapter_logprobs(base_dir: Path, adapter_dir: Path, rows: list[list[int]], *,
                     trust_remote_code_flag: bool | None = None) -> list[np.ndarray]:
    """The probe rows' logprobs of the adapter files loaded with PeftModel.from_pretrained on the base model."""
    remote = trust_remote_code(trust_remote_code_flag)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*tie_word_embeddings.*")
        model = PeftModel.from_pretrained(load_model(base_dir, remote), str(adapter_dir)).eval()
        out = logprobs(model, rows)
    del model
    gc.collect()
    return out


def merge_lora(peft_model: PeftModel) -> PreTrainedModel:
    """The base model with every LoRA merged into its weights (PEFT's merge, which applies each adapter's own
    scaling), after untying a tied output head that a LoRA touches."""
    untie_lora_targets(peft_model.get_base_model())
    merged: PreTrainedModel = peft_model.merge_and_unload(safe_merge=True)  # safe: refuses NaN weights
    return merged


def untie_lora_targets(model: Any) -> bool:
    """Give the output head its own copy of a tied embedding matrix when a LoRA sits on the head or on the
    embeddings, and mark the config untied; True when it untied."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None:
        return False
    head_base, embeddings_base = getattr(head, "base_layer", head), getattr(embeddings, "base_layer", embeddings)
    if head_base is head and embeddings_base is embeddings:
        return False  # no LoRA on either: they stay tied, as in the base model
    weight, shared = getattr(head_base, "weight", None), getattr(embeddings_base, "weight", None)
    if weight is None or shared is None or (weight is not shared and weight.data_ptr() != shared.data_ptr()):
        return False
    head_base.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    for config in _configs(model):
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    return True


def load_model(directory: Path, remote: bool) -> PreTrainedModel:
    """A model directory loaded on the CPU in float32 the way a user loads it: AutoModelForCausalLM, or
    AutoModelForImageTextToText for a vision-language model."""
    config = AutoConfig.from_pretrained(directory, trust_remote_code=remote)
    placement: dict[str, Any] = {"dtype": torch.float32, "device_map": {"": "cpu"}, "trust_remote_code": remote}
    if getattr(config, "vision_config", None) is not None:
        try:
            model: PreTrainedModel = AutoModelForImageTextToText.from_pretrained(directory, **placement)
            return model.eval()
        except ValueError:  # an architecture transformers maps to a causal LM only
            pass
    return AutoModelForCausalLM.from_pretrained(directory, **placement).eval()


@torch.no_grad()
def logprobs(model: nn.Module, rows: list[list[int]]) -> list[np.ndarray]:
    """Each row's next-token logprobs (inputs row[:-1], targets row[1:]), in float32."""
    out = []
    for row in rows:
        ids = torch.tensor([row[:-1]], dtype=torch.long)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        targets = torch.tensor(row[1:], dtype=torch.long)
        out.append(torch.log_softmax(logits, dim=-1)[torch.arange(len(targets)), targets].numpy())
    return out


def export_dtype(base_dir: Path, dtype: str, remote: bool = False) -> str:
    """The dtype name the merged weights are stored in: `dtype`, or for `auto` the base model's stored one."""
    if dtype != "auto":
        return dtype
    config = AutoConfig.from_pretrained(base_dir, trust_remote_code=remote)
    for source in _configs(config):
        stored = getattr(source, "dtype", None) or getattr(source, "torch_dtype", None)
        name = str(stored).removeprefix("torch.") if stored is not None else ""
        if name in DTYPES:
            return name
    return "float32"


def _configs(holder: Any) -> list[Any]:
    config = getattr(holder, "config", holder)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _write_generation_config(model: PreTrainedModel, out_dir: Path) -> None:
    if not (out_dir / "generation_config.json").is_file():  # save_pretrained writes it for generative models
        generation = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
        generation.save_pretrained(str(out_dir))


def _copy_tokenizer_files(base_dir: Path, out_dir: Path) -> None:
    for name in (*TOKENIZER_FILE_NAMES, *PROCESSOR_FILE_NAMES):
        source = base_dir / name
        if name not in _WRITTEN and source.is_file() and not (out_dir / name).exists():
            shutil.copyfile(source, out_dir / name)
