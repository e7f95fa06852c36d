"""HF ⇄ Megatron state dicts of a dense decoder: names, fused layouts and tensor-parallel shards.

Megatron fuses what HF keeps apart, and shards along the dimension its parallel linear layers split:

    HF (model.layers.N.…)                       Megatron (decoder.layers.N.…)              tp split
    self_attn.{q,k,v}_proj.{weight,bias}        self_attention.linear_qkv.{weight,bias}    dim 0, by group
    self_attn.o_proj.weight                     self_attention.linear_proj.weight          dim 1
    self_attn.{q,k}_norm.weight                 self_attention.{q,k}_layernorm.weight      replicated
    mlp.{gate,up}_proj.weight                   mlp.linear_fc1.weight                      dim 0, per half
    mlp.down_proj.weight                        mlp.linear_fc2.weight                      dim 1
    input_layernorm.weight                      input_layernorm.weight                     replicated
    post_attention_layernorm.weight             pre_mlp_layernorm.weight                   replicated
    model.embed_tokens.weight                   embedding.word_embeddings.weight           dim 0 (vocab)
    model.norm.weight                           decoder.final_layernorm.weight             replicated
    lm_head.weight                              output_layer.weight (absent when tied)     dim 0 (vocab)

With Transformer Engine's layer spec the two per-layer norms live inside the next linear layer instead:
`self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight` (`fused_norms=True`).

The fused QKV rows are grouped by key/value head: for each of the `num_kv_heads` groups, that group's
`heads_per_group` query heads, then its key head, then its value head. Tensor parallelism hands each rank
whole groups, so a rank's QKV shard is a contiguous block of rows. The fused gate/up rows are [gate; up],
but each rank holds [gate shard; up shard], so fc1 is split half by half. Every conversion here moves
values without arithmetic, so HF → Megatron → HF returns identical tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch

from twinkle.backends.megatron.architecture import Architecture
from twinkle.errors import InvalidRequest

Tensor = torch.Tensor
Split = Literal["rows", "columns", "row_halves", "replicated"]

HF_LAYER = "model.layers.{}."
MEGATRON_LAYER = "decoder.layers.{}."
# HF keys some checkpoints carry that hold no learned weight.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def layer_renames(arch: Architecture, *, fused_norms: bool) -> dict[str, str]:
    """HF → Megatron names, within one layer, of the tensors that are only renamed."""
    renames = {
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "mlp.down_proj.weight": "mlp.linear_fc2.weight",
        "input_layernorm.weight": (
            "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
        ),
        "post_attention_layernorm.weight": (
            "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
        ),
    }
    if arch.qk_norm:
        renames["self_attn.q_norm.weight"] = "self_attention.q_layernorm.weight"
        renames["self_attn.k_norm.weight"] = "self_attention.k_layernorm.weight"
    return renames


def global_renames(arch: Architecture) -> dict[str, str]:
    """HF → Megatron names of the tensors outside the layers."""
    renames = {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
    }
    if not arch.tied_embeddings:
        renames["lm_head.weight"] = "output_layer.weight"
    return renames


# Fused layouts


def interleave_groups(parts: Sequence[Tensor], groups: int, dim: int = 0) -> Tensor:
    """Concatenate `parts` group by group along `dim`: [p0 of group 0, p1 of group 0, ..., p0 of group 1, …].

    Works on weights (dim 0), biases and activations (dim -1): each part's `dim` is `groups` equal blocks.
    """
    dim = dim % parts[0].dim()
    blocks = [part.unflatten(dim, (groups, part.shape[dim] // groups)) for part in parts]
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)


def deinterleave_groups(fused: Tensor, sizes: Sequence[int], groups: int, dim: int = 0) -> list[Tensor]:
    """Inverse of interleave_groups: `sizes` are the parts' sizes along `dim` within one group."""
    dim = dim % fused.dim()
    blocks = fused.unflatten(dim, (groups, sum(sizes))).split(list(sizes), dim=dim + 1)
    return [block.flatten(dim, dim + 1) for block in blocks]


def qkv_group_sizes(arch: Architecture) -> tuple[int, int, int]:
    """Rows of one key/value group in the fused QKV: its query heads, its key head, its value head."""
    return arch.heads_per_group * arch.head_dim, arch.head_dim, arch.head_dim


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: Architecture) -> Tensor:
    return interleave_groups([q, k, v], arch.num_kv_heads)


def split_qkv(qkv: Tensor, arch: Architecture) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = deinterleave_groups(qkv, qkv_group_sizes(arch), arch.num_kv_heads)
    return q, k, v


# Whole state dicts


def iter_megatron_weights(
    hf: Mapping[str, Tensor], arch: Architecture, *, fused_norms: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """Megatron (name, tensor) pairs read from an HF state dict, one at a time.

    `hf` may be lazy (tensors read from disk on access), so a large model never sits in memory whole.
    """
    for hf_name, megatron_name in global_renames(arch).items():
        yield megatron_name, _take(hf, hf_name)
    renames = layer_renames(arch, fused_norms=fused_norms)
    for layer in range(arch.num_layers):
        hf_prefix, prefix = HF_LAYER.format(layer), MEGATRON_LAYER.format(layer)
        for hf_name, megatron_name in renames.items():
            yield prefix + megatron_name, _take(hf, hf_prefix + hf_name)
        attention = hf_prefix + "self_attn."
        q, k, v = (_take(hf, f"{attention}{name}_proj.weight") for name in "qkv")
        yield prefix + "self_attention.linear_qkv.weight", fuse_qkv(q, k, v, arch)
        if arch.qkv_bias:
            q, k, v = (_take(hf, f"{attention}{name}_proj.bias") for name in "qkv")
            yield prefix + "self_attention.linear_qkv.bias", fuse_qkv(q, k, v, arch)
        gate, up = _take(hf, hf_prefix + "mlp.gate_proj.weight"), _take(hf, hf_prefix + "mlp.up_proj.weight")
        yield prefix + "mlp.linear_fc1.weight", torch.cat([gate, up], dim=0)


def hf_to_megatron(
    hf: Mapping[str, Tensor], arch: Architecture, *, fused_norms: bool = False
) -> dict[str, Tensor]:
    """The Megatron (tp=1) state dict of an HF one; raises InvalidRequest on missing or unknown weights."""
    converted = dict(iter_megatron_weights(hf, arch, fused_norms=fused_norms))
    expected = set(megatron_to_hf(converted, arch, fused_norms=fused_norms))
    if arch.tied_embeddings:
        expected.add("lm_head.weight")  # a tied checkpoint may store the shared matrix twice
    unknown = sorted(name for name in hf if name not in expected and not name.endswith(_IGNORED_HF_SUFFIXES))
    if unknown:
        raise InvalidRequest(
            f"The checkpoint holds {len(unknown)} weights this {arch.model_type} layout does not know, "
            f"e.g. {unknown[:3]}.",
            hint="The model's architecture differs from what its config says; use backend: transformers.",
        )
    return converted


def megatron_to_hf(
    megatron: Mapping[str, Tensor], arch: Architecture, *, fused_norms: bool = False
) -> dict[str, Tensor]:
    """The HF state dict of a Megatron (tp=1) one."""
    hf = {hf_name: _take(megatron, name) for hf_name, name in global_renames(arch).items()}
    renames = layer_renames(arch, fused_norms=fused_norms)
    for layer in range(arch.num_layers):
        hf_prefix, prefix = HF_LAYER.format(layer), MEGATRON_LAYER.format(layer)
        for hf_name, megatron_name in renames.items():
            hf[hf_prefix + hf_name] = _take(megatron, prefix + megatron_name)
        attention = hf_prefix + "self_attn."
        fused = _take(megatron, prefix + "self_attention.linear_qkv.weight")
        for name, tensor in zip("qkv", split_qkv(fused, arch), strict=True):
            hf[f"{attention}{name}_proj.weight"] = tensor
        if arch.qkv_bias:
            fused_bias = _take(megatron, prefix + "self_attention.linear_qkv.bias")
            for name, tensor in zip("qkv", split_qkv(fused_bias, arch), strict=True):
                hf[f"{attention}{name}_proj.bias"] = tensor
        gate, up = _take(megatron, prefix + "mlp.linear_fc1.weight").chunk(2, dim=0)
        hf[hf_prefix + "mlp.gate_proj.weight"] = gate
        hf[hf_prefix + "mlp.up_proj.weight"] = up
    return hf


def _take(state: Mapping[str, Tensor], name: str) -> Tensor:
    try:
        return state[name]
    except KeyError:
        raise InvalidRequest(
            f"The checkpoint lacks the weight {name!r}.",
            hint="Check that model_id points at a complete checkpoint of a supported architecture.",
        ) from None


# Tensor parallelism


def tensor_parallel_split(name: str) -> Split:
    """How a Megatron base weight is divided among tensor-parallel ranks."""
    if name.endswith(
        ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
    ):
        return "rows"
    if name.endswith("linear_fc1.weight"):
        return "row_halves"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "columns"
    return "replicated"


def shard(tensor: Tensor, split: Split, rank: int, size: int) -> Tensor:
    """Rank `rank`'s part of a full tensor."""
    if split == "rows":
        return tensor.chunk(size, dim=0)[rank]
    if split == "columns":
        return tensor.chunk(size, dim=1)[rank]
    if split == "row_halves":
        return torch.cat([half.chunk(size, dim=0)[rank] for half in tensor.chunk(2, dim=0)], dim=0)
    return tensor


def unshard(shards: Sequence[Tensor], split: Split) -> Tensor:
    """The full tensor from every rank's part, in rank order; replicated parts must agree."""
    if split == "rows":
        return torch.cat(list(shards), dim=0)
    if split == "columns":
        return torch.cat(list(shards), dim=1)
    if split == "row_halves":
        halves = [part.chunk(2, dim=0) for part in shards]
        return torch.cat([torch.cat([half[index] for half in halves], dim=0) for index in (0, 1)], dim=0)
    first = shards[0]
    if any(not torch.equal(first, other) for other in shards[1:]):
        raise ValueError("replicated tensor differs between tensor-parallel ranks")
    return first


def split_state(state: Mapping[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    """Each tensor-parallel rank's state dict from a full (tp=1) Megatron state dict."""
    return [
        {name: shard(tensor, tensor_parallel_split(name), rank, size) for name, tensor in state.items()}
        for rank in range(size)
    ]


def merge_states(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The full Megatron state dict from every tensor-parallel rank's, in rank order."""
    return {
        name: unshard([state[name] for state in states], tensor_parallel_split(name)) for name in states[0]
    }
