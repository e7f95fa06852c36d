"""The linear layers a transformers pool publishes for adapter imports, and an imported PEFT adapter, checked
against them and written anew, computing in the backend exactly what it computes in PEFT."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from twinkle import adapter_import
from twinkle.adapter_import import ModuleShapes
from twinkle.backends.hf.lora_modules import lora_module_shapes, published_shapes
from twinkle.backends.transformers_backend import TransformersBackend
from twinkle.types import Datum, ForwardBackwardInput, LoraSpec, chunks_from_tokens

TOKENS = [5, 17, 42, 8, 99, 3, 250, 7]


def peft_adapter(model_dir: Path, out: Path, **options: Any) -> PeftModel:
    """A PEFT adapter made on the tiny model with random (non-zero) A and B, saved to `out`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **options))
    peft.save_pretrained(out, save_embedding_layers=False)  # the output head's base weight stays out
    return peft


def tar_of(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(directory.iterdir()):
            tar.add(path, arcname=path.name)
    return buffer.getvalue()


def imported(backend: TransformersBackend, adapter_dir: Path, tmp_path: Path) -> tuple[Path, LoraSpec]:
    """What the import route does: parse the upload, check it against the published shapes, write it."""
    tmp_path.mkdir(exist_ok=True)
    archive = tmp_path / "upload.tar"
    archive.write_bytes(tar_of(adapter_dir))
    upload = adapter_import.parse_upload(archive, tmp_path / "staging", max_bytes=1 << 30)
    shapes = ModuleShapes.from_json(lora_module_shapes(backend.shared))
    spec = adapter_import.check_against_base(upload, shapes, "tiny-qwen")
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    adapter_import.write_adapter(upload, spec, "tiny-qwen", checkpoint)
    return checkpoint, spec


def backend_logprobs(backend: TransformersBackend, adapter_id: str) -> np.ndarray:
    datum = Datum(chunks_from_tokens(TOKENS[:-1]), {"target_tokens": np.asarray(TOKENS[1:], np.int64),
                                                     "weights": np.ones(len(TOKENS) - 1, np.float32)})
    out = backend.forward(adapter_id, ForwardBackwardInput([datum]))
    return np.asarray(out.loss_fn_outputs[0]["logprobs"])


def peft_logprobs(peft: PeftModel) -> np.ndarray:
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return logprobs[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].numpy()


def test_the_published_shapes_are_the_models_linear_layers_before_and_after_adapters_exist(
        backend: TransformersBackend) -> None:
    before = lora_module_shapes(backend.shared)
    assert before["unembed"] == "lm_head"
    assert before["modules"]["model.layers.0.self_attn.q_proj"] == [64, 64]
    assert before["modules"]["model.layers.1.self_attn.k_proj"] == [32, 64]
    assert before["modules"]["model.layers.0.mlp.down_proj"] == [64, 128]
    assert before["modules"]["lm_head"] == [512, 64]
    assert len(before["modules"]) == 15  # 7 per layer, 2 layers, and the output head
    backend.create_adapter("a", LoraSpec(rank=4))
    assert lora_module_shapes(backend.shared) == before  # PEFT's wrappers report their base layer's shape
    assert published_shapes(backend) == before
    assert published_shapes(object()) is None


@pytest.mark.parametrize("options", [
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    {"r": 2, "lora_alpha": 16, "target_modules": ["down_proj", "lm_head"], "layers_to_transform": [1]},
], ids=["attention", "some-layers"])
def test_an_imported_peft_adapter_computes_in_the_backend_what_it_computes_in_peft(
        backend: TransformersBackend, tiny_model_dir: Path, tmp_path: Path, options: dict[str, Any]) -> None:
    peft = peft_adapter(tiny_model_dir, tmp_path / "adapter", **options)
    checkpoint, spec = imported(backend, tmp_path / "adapter", tmp_path)
    assert spec.rank == options["r"] and spec.alpha == options["lora_alpha"]
    backend.create_adapter("imported", spec)
    backend.load_state("imported", checkpoint, include_optimizer=False)
    np.testing.assert_allclose(backend_logprobs(backend, "imported"), peft_logprobs(peft), rtol=1e-5, atol=1e-5)
    backend.create_adapter("fresh", LoraSpec(rank=4))
    assert not np.allclose(backend_logprobs(backend, "fresh"), peft_logprobs(peft), atol=1e-4)


def test_short_target_names_are_kept_when_they_pick_exactly_the_adapted_layers(
        backend: TransformersBackend, tiny_model_dir: Path, tmp_path: Path) -> None:
    peft_adapter(tiny_model_dir, tmp_path / "all", r=4, target_modules=["q_proj", "v_proj"])
    assert imported(backend, tmp_path / "all", tmp_path / "a")[1].target_modules == ("q_proj", "v_proj")
    peft_adapter(tiny_model_dir, tmp_path / "some", r=4, target_modules=["q_proj"], layers_to_transform=[0])
    spec = imported(backend, tmp_path / "some", tmp_path / "b")[1]
    assert spec.target_modules == ("model.layers.0.self_attn.q_proj",)  # not layer 1's q_proj
    assert (spec.train_attn, spec.train_mlp, spec.train_unembed) == (True, False, False)


def test_the_torch_sampler_loads_an_imported_checkpoint(backend: TransformersBackend, tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    peft = peft_adapter(tiny_model_dir, tmp_path / "adapter", r=4, target_modules=["q_proj", "up_proj"])
    checkpoint, _ = imported(backend, tmp_path / "adapter", tmp_path)
    backend.shared.load_adapter("served", checkpoint)  # what the sampler pool does with a sampler checkpoint
    backend.shared.activate("served")
    with torch.no_grad():
        logits = backend.shared(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float()
    with torch.no_grad():
        expected = peft(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
