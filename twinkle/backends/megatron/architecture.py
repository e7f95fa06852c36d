"""A base model's HF config as the numbers Megatron needs to build the same network.

Supported: dense decoder-only models of the Qwen2 / Qwen3 / Llama / Mistral kind, i.e. grouped-query
attention, SwiGLU MLP, RMSNorm, plain rotary embeddings (no scaling, no sliding window), optionally QKV
biases (Qwen2) and per-head query/key RMSNorm (Qwen3). Anything else is refused with the reason, since a
silently different network would train the wrong model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinkle.errors import InvalidRequest

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Architecture:
    """The shape of one dense decoder, in HF terms."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def tensor_parallel_problems(self, tp_size: int) -> list[str]:
        """Why this model cannot be split `tp_size` ways (empty when it can)."""
        sizes = {
            "num_key_value_heads": self.num_kv_heads,
            "num_attention_heads": self.num_heads,
            "intermediate_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
        }
        return [
            f"{name}={value} is not divisible by tp_size={tp_size}"
            for name, value in sizes.items()
            if value % tp_size
        ]

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> Architecture:
        """Read a transformers PretrainedConfig; raise InvalidRequest naming every unsupported feature."""
        model_type = str(getattr(config, "model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidRequest(
                f"backend: megatron cannot build a {model_type or 'unknown'!r} model yet.",
                hint=f"Supported: {', '.join(SUPPORTED_MODEL_TYPES)}; use backend: transformers for others.",
            )
        problems = _unsupported_features(config, model_type)
        if problems:
            raise InvalidRequest(
                f"backend: megatron cannot build this {model_type} model: " + "; ".join(problems) + ".",
                hint="Use backend: transformers for this model.",
            )
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        return cls(
            model_type=model_type,
            num_layers=int(config.num_hidden_layers),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            norm_eps=float(config.rms_norm_eps),
            rope_theta=_rope_theta(config),
            max_position_embeddings=int(config.max_position_embeddings),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def _unsupported_features(config: PretrainedConfig, model_type: str) -> list[str]:
    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (only silu, as in SwiGLU)")
    if model_type != "qwen2" and getattr(config, "attention_bias", False):
        problems.append("attention_bias=True (biases on the output projection too)")
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias=True")
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        problems.append("sliding-window attention")
    rope_type = _rope_parameters(config).get("rope_type", _rope_parameters(config).get("type", "default"))
    if rope_type not in (None, "default"):
        problems.append(f"rope scaling {rope_type!r} (only plain rotary embeddings)")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return problems


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """transformers 5 keeps rotary settings in `rope_parameters`; 4.x in `rope_theta` and `rope_scaling`."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(parameters)


def _rope_theta(config: PretrainedConfig) -> float:
    theta = _rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)
