"""PEFT ⇄ Megatron names of one tenant's LoRA weights, and how they split over tensor-parallel ranks.

A LoRA pair (A: rank × in, B: out × rank) belongs to one HF projection. Megatron fuses q/k/v into
`linear_qkv` and gate/up into `linear_fc1`, but one LoRA over a fused layer would share A between q, k and v
and could not be saved as PEFT weights. So each HF projection keeps its own pair, stored under the Megatron
layer it feeds and named after the projection ("part"):

    PEFT  base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
    Meg.  decoder.layers.N.self_attention.linear_qkv.lora.q_proj.linear_in.weight
    PEFT  base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight
    Meg.  decoder.layers.N.self_attention.linear_qkv.lora.q_proj.linear_out.weight

and likewise k_proj, v_proj → linear_qkv; o_proj → self_attention.linear_proj; mlp.gate_proj, up_proj →
mlp.linear_fc1; down_proj → mlp.linear_fc2; lm_head.lora_{A,B} → output_layer.lora.lm_head.linear_{in,out}.

The tensors themselves are identical on both sides. Over tensor-parallel ranks, a pair on a column-parallel
layer (qkv, fc1, output) keeps A whole and splits B's rows like the layer's output; a pair on a row-parallel
layer (proj, fc2) splits A's columns like the layer's input and keeps B whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from twinkle.backends.megatron.architecture import Architecture
from twinkle.backends.megatron.weight_layout import Split, shard, unshard
from twinkle.errors import InvalidRequest

Tensor = torch.Tensor

PEFT_PREFIX = "base_model.model."
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
LAYER_PARTS = ATTENTION_PARTS + MLP_PARTS
UNEMBED_PART = "lm_head"
ALL_PARTS = (*LAYER_PARTS, UNEMBED_PART)

# Each HF projection: its HF module within a layer, the Megatron layer it feeds, and that layer's split.
_LAYER_TARGETS: dict[str, tuple[str, str, str]] = {
    "q_proj": ("self_attn.q_proj", "self_attention.linear_qkv", "column"),
    "k_proj": ("self_attn.k_proj", "self_attention.linear_qkv", "column"),
    "v_proj": ("self_attn.v_proj", "self_attention.linear_qkv", "column"),
    "o_proj": ("self_attn.o_proj", "self_attention.linear_proj", "row"),
    "gate_proj": ("mlp.gate_proj", "mlp.linear_fc1", "column"),
    "up_proj": ("mlp.up_proj", "mlp.linear_fc1", "column"),
    "down_proj": ("mlp.down_proj", "mlp.linear_fc2", "row"),
}


@dataclass(frozen=True)
class LoraTarget:
    """One HF projection carrying a LoRA pair, located on both sides."""

    part: str  # the HF projection name: q_proj, ..., down_proj, lm_head
    peft_module: str  # e.g. base_model.model.model.layers.0.self_attn.q_proj
    megatron_module: str  # e.g. decoder.layers.0.self_attention.linear_qkv
    parallel: str  # "column" or "row": how the Megatron layer splits over tensor-parallel ranks

    @property
    def peft_keys(self) -> tuple[str, str]:
        return f"{self.peft_module}.lora_A.weight", f"{self.peft_module}.lora_B.weight"

    @property
    def megatron_keys(self) -> tuple[str, str]:
        prefix = f"{self.megatron_module}.lora.{self.part}"
        return f"{prefix}.linear_in.weight", f"{prefix}.linear_out.weight"

    @property
    def splits(self) -> tuple[Split, Split]:
        """How A and B split over tensor-parallel ranks."""
        return ("replicated", "rows") if self.parallel == "column" else ("columns", "replicated")


def resolve_parts(target_modules: Sequence[str] | str) -> tuple[str, ...]:
    """The HF projections a LoRA target list names, in PEFT's order; InvalidRequest for others."""
    if target_modules == "all-linear":  # PEFT's meaning: every linear layer except the output head
        return LAYER_PARTS
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    unknown = sorted({name for name in names if name not in ALL_PARTS})
    if unknown:
        raise InvalidRequest(
            f"backend: megatron cannot put LoRA adapters on {unknown}.",
            hint=f"Choose among {', '.join(ALL_PARTS)} or 'all-linear'.",
        )
    return tuple(part for part in ALL_PARTS if part in names)


def lora_targets(arch: Architecture, parts: Iterable[str]) -> list[LoraTarget]:
    """Every LoRA pair of an adapter on `parts`, in the order PEFT lists the model's parameters."""
    wanted = set(parts)
    targets = []
    for layer in range(arch.num_layers):
        for part in LAYER_PARTS:
            if part in wanted:
                hf_module, megatron_module, parallel = _LAYER_TARGETS[part]
                targets.append(
                    LoraTarget(
                        part,
                        f"{PEFT_PREFIX}model.layers.{layer}.{hf_module}",
                        f"decoder.layers.{layer}.{megatron_module}",
                        parallel,
                    )
                )
    if UNEMBED_PART in wanted:
        targets.append(LoraTarget(UNEMBED_PART, f"{PEFT_PREFIX}lm_head", "output_layer", "column"))
    return targets


def peft_to_megatron(peft: Mapping[str, Tensor], targets: Sequence[LoraTarget]) -> dict[str, Tensor]:
    """Megatron-named LoRA weights from PEFT-named ones; InvalidRequest when the sets differ."""
    expected = {key for target in targets for key in target.peft_keys}
    if set(peft) != expected:
        missing, unknown = sorted(expected - set(peft)), sorted(set(peft) - expected)
        raise InvalidRequest(
            f"The LoRA weights do not fit this adapter: {len(missing)} missing (e.g. {missing[:2]}), "
            f"{len(unknown)} unexpected (e.g. {unknown[:2]}).",
            hint="Create the model with the checkpoint's LoRA config before loading it.",
        )
    return {
        megatron_key: peft[peft_key]
        for target in targets
        for peft_key, megatron_key in zip(target.peft_keys, target.megatron_keys, strict=True)
    }


def megatron_to_peft(megatron: Mapping[str, Tensor], targets: Sequence[LoraTarget]) -> dict[str, Tensor]:
    """PEFT-named LoRA weights, in PEFT's parameter order, from Megatron-named ones."""
    return {
        peft_key: megatron[megatron_key]
        for target in targets
        for peft_key, megatron_key in zip(target.peft_keys, target.megatron_keys, strict=True)
    }


def key_splits(targets: Sequence[LoraTarget]) -> dict[str, Split]:
    """Megatron LoRA key → how that tensor splits over tensor-parallel ranks."""
    return {
        key: split
        for target in targets
        for key, split in zip(target.megatron_keys, target.splits, strict=True)
    }


def split_lora_state(
    state: Mapping[str, Tensor], targets: Sequence[LoraTarget], size: int
) -> list[dict[str, Tensor]]:
    """Each tensor-parallel rank's LoRA weights from full (tp=1) Megatron-named ones."""
    splits = key_splits(targets)
    return [
        {key: shard(value, splits[key], rank, size) for key, value in state.items()} for rank in range(size)
    ]


def merge_lora_states(
    states: Sequence[Mapping[str, Tensor]], targets: Sequence[LoraTarget]
) -> dict[str, Tensor]:
    """Full Megatron-named LoRA weights from every tensor-parallel rank's, in rank order."""
    splits = key_splits(targets)
    return {key: unshard([state[key] for state in states], splits[key]) for key in states[0]}
