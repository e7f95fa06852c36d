"""The base model as a Megatron GPTModel: built from the HF config, loaded with the HF weights.

The layers come from Megatron's local layer spec (megatron-core modules only, no Transformer Engine), so
the LoRA hooks see each linear layer's real input and the same code runs wherever megatron-core runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from safetensors import safe_open

from twinkle.backends.megatron.architecture import Architecture
from twinkle.backends.megatron.weight_layout import iter_megatron_weights, shard, tensor_parallel_split
from twinkle.errors import InvalidRequest

Tensor = torch.Tensor


def transformer_config(
    arch: Architecture, *, dtype: torch.dtype, tp_size: int, device: torch.device
) -> TransformerConfig:
    """Megatron's description of the same network, with every fusion that needs CUDA kernels off."""
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp_size,
        pipeline_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # every weight is overwritten by the checkpoint's
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_model(arch: Architecture, config: TransformerConfig, device: torch.device) -> GPTModel:
    """An empty GPTModel of the architecture on `device`, frozen (only LoRA weights train)."""
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # type: ignore[arg-type]  # typed int, used as a float
        share_embeddings_and_output_weights=arch.tied_embeddings,
        parallel_output=True,
    ).to(device)
    model.requires_grad_(False)
    return model


def load_hf_weights(
    model: GPTModel, weights: Mapping[str, Tensor], arch: Architecture, tp_rank: int, tp_size: int
) -> None:
    """Copy the HF checkpoint into the model, one converted tensor at a time, each rank its own shard."""
    params = {name: value for name, value in model.state_dict().items() if not name.endswith("_extra_state")}
    loaded = set()
    with torch.no_grad():
        for name, full in iter_megatron_weights(weights, arch):
            if name not in params:
                raise InvalidRequest(f"Megatron's model has no weight {name!r} for this checkpoint.")
            local = shard(full, tensor_parallel_split(name), tp_rank, tp_size)
            if local.shape != params[name].shape:
                raise InvalidRequest(
                    f"Weight {name} has shape {list(local.shape)} on tensor-parallel rank {tp_rank}, "
                    f"but the model expects {list(params[name].shape)}."
                )
            params[name].copy_(local)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise InvalidRequest(
            f"The checkpoint left {len(missing)} Megatron weights unset, e.g. {missing[:3]}."
        )


class SafetensorsWeights(Mapping[str, Tensor]):
    """The tensors of an HF checkpoint directory, read from disk one at a time on access."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            self._files = {
                name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()
            }
        elif (directory / "model.safetensors").is_file():
            single = directory / "model.safetensors"
            with safe_open(str(single), framework="pt") as handle:
                self._files = dict.fromkeys(handle.keys(), single)
        else:
            raise InvalidRequest(
                f"{directory.name} has no safetensors weights (model.safetensors or an index).",
                hint="backend: megatron reads safetensors checkpoints only.",
            )

    def __getitem__(self, name: str) -> Tensor:
        with safe_open(str(self._files[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
