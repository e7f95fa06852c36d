"""PEFT ⇄ Megatron LoRA names and tensor-parallel shards, checked against a real PEFT adapter's state dict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle.backends.hf.lora import lora_config, target_modules
from twinkle.backends.megatron.architecture import Architecture
from twinkle.backends.megatron.lora_layout import (
    LAYER_PARTS,
    lora_targets,
    megatron_to_peft,
    merge_lora_states,
    peft_to_megatron,
    resolve_parts,
    split_lora_state,
)
from twinkle.errors import InvalidRequest
from twinkle.types import LoraSpec

Tensor = torch.Tensor


@pytest.fixture(scope="module")
def peft_adapter(tiny_model_dir: Path) -> tuple[Architecture, dict[str, Tensor], list[str]]:
    """A PEFT adapter on every linear layer and the head of the tiny model, with random (nonzero) B."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    spec = LoraSpec(rank=4)
    peft = get_peft_model(model, lora_config(spec, base_model_name="tiny"), adapter_name="tenant")
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param))
    state = {
        key: value.clone()
        for key, value in get_peft_model_state_dict(
            peft, adapter_name="tenant", save_embedding_layers=False
        ).items()
    }
    order = [name.replace(".tenant", "") for name, _ in peft.named_parameters() if ".tenant." in name]
    arch = Architecture.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir))
    return arch, state, order


def test_default_lora_spec_targets_every_projection_and_the_head() -> None:
    assert resolve_parts(target_modules(LoraSpec(), "lm_head")) == (*LAYER_PARTS, "lm_head")
    assert resolve_parts(target_modules(LoraSpec(train_mlp=False, train_unembed=False), "lm_head")) == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    )
    assert resolve_parts("all-linear") == LAYER_PARTS


def test_unknown_target_modules_are_refused_with_the_choices() -> None:
    with pytest.raises(InvalidRequest, match=r"cannot put LoRA adapters on \['embed_tokens'\]") as error:
        resolve_parts(["q_proj", "embed_tokens"])
    assert error.value.hint is not None and "lm_head" in error.value.hint


def test_peft_names_convert_to_megatron_names_and_back_exactly(
    peft_adapter: tuple[Architecture, dict[str, Tensor], list[str]],
) -> None:
    arch, peft_state, _ = peft_adapter
    targets = lora_targets(arch, resolve_parts(target_modules(LoraSpec(), "lm_head")))
    megatron = peft_to_megatron(peft_state, targets)
    assert (
        megatron["decoder.layers.1.self_attention.linear_qkv.lora.k_proj.linear_in.weight"]
        is peft_state["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"]
    )
    assert "output_layer.lora.lm_head.linear_out.weight" in megatron
    assert "decoder.layers.0.mlp.linear_fc1.lora.up_proj.linear_out.weight" in megatron
    back = megatron_to_peft(megatron, targets)
    assert list(back) == sorted(back, key=list(peft_state).index)
    assert back.keys() == peft_state.keys()
    assert all(torch.equal(back[key], peft_state[key]) for key in peft_state)


def test_megatron_order_is_pefts_parameter_order(
    peft_adapter: tuple[Architecture, dict[str, Tensor], list[str]],
) -> None:
    """Optimizer states line up between the backends only if both list the parameters in one order."""
    arch, _, peft_order = peft_adapter
    targets = lora_targets(arch, resolve_parts(target_modules(LoraSpec(), "lm_head")))
    assert [key for target in targets for key in target.peft_keys] == peft_order


def test_a_checkpoint_with_other_targets_is_refused(
    peft_adapter: tuple[Architecture, dict[str, Tensor], list[str]],
) -> None:
    arch, peft_state, _ = peft_adapter
    attention_only = lora_targets(arch, ("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(InvalidRequest, match=r"0 missing .* 14 unexpected"):
        peft_to_megatron(peft_state, attention_only)


def test_lora_shards_follow_the_parallel_layer_they_feed(
    peft_adapter: tuple[Architecture, dict[str, Tensor], list[str]],
) -> None:
    arch, peft_state, _ = peft_adapter
    targets = lora_targets(arch, resolve_parts(target_modules(LoraSpec(), "lm_head")))
    full = peft_to_megatron(peft_state, targets)
    ranks = split_lora_state(full, targets, 2)
    qkv = "decoder.layers.0.self_attention.linear_qkv.lora.q_proj."
    proj = "decoder.layers.0.self_attention.linear_proj.lora.o_proj."
    # Column-parallel layer: A whole on each rank, B's output rows split.
    assert torch.equal(ranks[1][qkv + "linear_in.weight"], full[qkv + "linear_in.weight"])
    assert torch.equal(ranks[1][qkv + "linear_out.weight"], full[qkv + "linear_out.weight"][32:])
    # Row-parallel layer: A's input columns split, B whole.
    assert torch.equal(ranks[1][proj + "linear_in.weight"], full[proj + "linear_in.weight"][:, 32:])
    assert torch.equal(ranks[1][proj + "linear_out.weight"], full[proj + "linear_out.weight"])
    merged = merge_lora_states(ranks, targets)
    assert merged.keys() == full.keys() and all(torch.equal(merged[key], full[key]) for key in full)
