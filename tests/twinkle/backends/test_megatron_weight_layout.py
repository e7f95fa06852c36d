"""HF ⇄ Megatron weight names and layouts, checked on tiny models' state dicts without megatron-core."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

from twinkle.backends.megatron import weight_layout
from twinkle.backends.megatron.architecture import Architecture
from twinkle.backends.megatron.weight_layout import (
    hf_to_megatron,
    megatron_to_hf,
    merge_states,
    split_qkv,
    split_state,
)
from twinkle.errors import InvalidRequest

Tensor = torch.Tensor


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir: Path) -> tuple[Architecture, dict[str, Tensor]]:
    """The session's tiny Qwen3 (q/k norms, untied head) as its architecture and HF state dict."""
    arch = Architecture.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir))
    return arch, load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def qwen2() -> tuple[Architecture, dict[str, Tensor]]:
    """A tiny Qwen2 (QKV biases, tied embeddings, 3 query heads per key/value head)."""
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    del state["lm_head.weight"]  # a tied checkpoint stores the shared matrix once, as the embedding
    return Architecture.from_hf_config(config), state


def assert_identical(left: dict[str, Tensor], right: dict[str, Tensor]) -> None:
    assert sorted(left) == sorted(right)
    for name, tensor in left.items():
        assert torch.equal(tensor, right[name]), name


# Architecture


def test_the_tiny_qwen3_reads_as_gqa_with_query_key_norms(
    qwen3: tuple[Architecture, dict[str, Tensor]],
) -> None:
    arch, _ = qwen3
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.heads_per_group) == (4, 2, 16, 2)
    assert arch.qk_norm and not arch.qkv_bias and not arch.tied_embeddings


def test_qwen2_reads_with_qkv_biases_and_tied_embeddings(
    qwen2: tuple[Architecture, dict[str, Tensor]],
) -> None:
    arch, _ = qwen2
    assert arch.qkv_bias and arch.tied_embeddings and not arch.qk_norm
    assert arch.heads_per_group == 3


def test_unsupported_architectures_are_refused_with_the_reason() -> None:
    config = Qwen2Config(hidden_act="gelu", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(InvalidRequest) as error:
        Architecture.from_hf_config(config)
    assert "hidden_act 'gelu'" in error.value.message and "rope scaling 'linear'" in error.value.message
    with pytest.raises(InvalidRequest, match="cannot build a 'gpt2' model"):
        Architecture.from_hf_config(AutoConfig.for_model("gpt2"))


def test_tensor_parallel_sizes_that_do_not_divide_the_model_are_named(
    qwen2: tuple[Architecture, dict[str, Tensor]],
) -> None:
    arch, _ = qwen2
    assert arch.tensor_parallel_problems(2) == []
    assert arch.tensor_parallel_problems(4) == [
        "num_key_value_heads=2 is not divisible by tp_size=4",
        "num_attention_heads=6 is not divisible by tp_size=4",
    ]


# Names and layouts


@pytest.mark.parametrize("fused_norms", [False, True])
def test_qwen3_round_trip_returns_every_tensor_unchanged(
    qwen3: tuple[Architecture, dict[str, Tensor]], fused_norms: bool
) -> None:
    arch, hf = qwen3
    megatron = hf_to_megatron(hf, arch, fused_norms=fused_norms)
    assert_identical(megatron_to_hf(megatron, arch, fused_norms=fused_norms), hf)


def test_qwen2_round_trip_with_biases_and_tied_embeddings_is_exact(
    qwen2: tuple[Architecture, dict[str, Tensor]],
) -> None:
    arch, hf = qwen2
    megatron = hf_to_megatron(hf, arch)
    assert "output_layer.weight" not in megatron  # Megatron shares the embedding with the output layer
    assert megatron["decoder.layers.1.self_attention.linear_qkv.bias"].shape == (48 + 2 * 2 * 8,)
    assert_identical(megatron_to_hf(megatron, arch), hf)


def test_megatron_names_follow_the_local_layer_spec(qwen3: tuple[Architecture, dict[str, Tensor]]) -> None:
    arch, hf = qwen3
    names = {name for name in hf_to_megatron(hf, arch) if not name.startswith("decoder.layers.1.")}
    assert names == {
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.self_attention.k_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    }
    fused = hf_to_megatron(hf, arch, fused_norms=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in fused
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in fused
    assert torch.equal(
        fused["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
        hf["model.layers.0.post_attention_layernorm.weight"],
    )


def test_fused_qkv_gives_the_projections_megatron_splits_per_key_value_group(
    qwen2: tuple[Architecture, dict[str, Tensor]],
) -> None:
    """Megatron views the fused output as [groups, (heads_per_group + 2) * head_dim] and splits each group."""
    arch, hf = qwen2
    megatron = hf_to_megatron(hf, arch)
    x = torch.randn(5, arch.hidden_size)
    fused_out = x @ megatron["decoder.layers.0.self_attention.linear_qkv.weight"].T
    grouped = fused_out.view(5, arch.num_kv_heads, (arch.heads_per_group + 2) * arch.head_dim)
    q, k, v = grouped.split([arch.heads_per_group * arch.head_dim, arch.head_dim, arch.head_dim], dim=-1)
    prefix = "model.layers.0.self_attn."
    torch.testing.assert_close(q.reshape(5, -1), x @ hf[prefix + "q_proj.weight"].T)
    torch.testing.assert_close(k.reshape(5, -1), x @ hf[prefix + "k_proj.weight"].T)
    torch.testing.assert_close(v.reshape(5, -1), x @ hf[prefix + "v_proj.weight"].T)


def test_fc1_is_gate_then_up_as_megatrons_swiglu_reads_it(
    qwen3: tuple[Architecture, dict[str, Tensor]],
) -> None:
    arch, hf = qwen3
    fc1 = hf_to_megatron(hf, arch)["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2, dim=0)  # megatron.core.transformer.mlp: glu chunks the output in two, gate first
    assert torch.equal(gate, hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, hf["model.layers.0.mlp.up_proj.weight"])


def test_missing_and_unknown_weights_are_refused(qwen3: tuple[Architecture, dict[str, Tensor]]) -> None:
    arch, hf = qwen3
    incomplete = {name: tensor for name, tensor in hf.items() if "layers.1.mlp.up_proj" not in name}
    with pytest.raises(InvalidRequest, match=r"lacks the weight 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        hf_to_megatron(incomplete, arch)
    with pytest.raises(InvalidRequest, match="1 weights this qwen3 layout does not know"):
        hf_to_megatron({**hf, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, arch)
    # Buffers some checkpoints carry are not weights and are skipped.
    hf_to_megatron({**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}, arch)


# Tensor parallelism


@pytest.mark.parametrize("tp_size", [1, 2])
def test_tensor_parallel_split_then_merge_is_exact(
    qwen2: tuple[Architecture, dict[str, Tensor]], tp_size: int
) -> None:
    arch, hf = qwen2
    full = hf_to_megatron(hf, arch)
    shards = split_state(full, tp_size)
    assert len(shards) == tp_size
    assert_identical(merge_states(shards), full)
    assert_identical(megatron_to_hf(merge_states(shards), arch), hf)


def test_each_rank_holds_whole_key_value_groups_and_its_share_of_gate_and_up(
    qwen2: tuple[Architecture, dict[str, Tensor]],
) -> None:
    arch, hf = qwen2
    rank1 = split_state(hf_to_megatron(hf, arch), 2)[1]
    prefix = "model.layers.0."
    # Rank 1 serves key/value group 1: query heads 3..5, key head 1, value head 1.
    local = Architecture(**{**arch.__dict__, "num_heads": 3, "num_kv_heads": 1})
    q, k, v = split_qkv(rank1["decoder.layers.0.self_attention.linear_qkv.weight"], local)
    assert torch.equal(q, hf[prefix + "self_attn.q_proj.weight"][3 * 8 :])
    assert torch.equal(k, hf[prefix + "self_attn.k_proj.weight"][8:])
    assert torch.equal(v, hf[prefix + "self_attn.v_proj.weight"][8:])
    gate, up = rank1["decoder.layers.0.mlp.linear_fc1.weight"].chunk(2, dim=0)
    assert torch.equal(gate, hf[prefix + "mlp.gate_proj.weight"][32:])
    assert torch.equal(up, hf[prefix + "mlp.up_proj.weight"][32:])
    assert torch.equal(
        rank1["decoder.layers.0.mlp.linear_fc2.weight"], hf[prefix + "mlp.down_proj.weight"][:, 32:]
    )
    assert torch.equal(rank1["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"][48:])
    assert torch.equal(
        rank1["decoder.layers.0.input_layernorm.weight"], hf[prefix + "input_layernorm.weight"]
    )


def test_merging_ranks_whose_replicated_weights_disagree_fails(
    qwen3: tuple[Architecture, dict[str, Tensor]],
) -> None:
    arch, hf = qwen3
    shards = split_state(hf_to_megatron(hf, arch), 2)
    shards[1] = {
        **shards[1],
        "decoder.final_layernorm.weight": shards[1]["decoder.final_layernorm.weight"] + 1,
    }
    with pytest.raises(ValueError, match="differs between tensor-parallel ranks"):
        merge_states(shards)


def test_interleave_groups_works_on_the_last_dimension_of_activations() -> None:
    q, k = torch.arange(12.0).view(2, 6), torch.arange(100.0, 104.0).view(2, 2)
    fused = weight_layout.interleave_groups([q, k], groups=2, dim=-1)
    assert fused[0].tolist() == [0, 1, 2, 100, 3, 4, 5, 101]
    back = weight_layout.deinterleave_groups(fused, [3, 1], groups=2, dim=-1)
    assert torch.equal(back[0], q) and torch.equal(back[1], k)
