"""Turn a tenant's LoraSpec into a PEFT LoraConfig."""

from __future__ import annotations

from typing import cast

from peft import LoraConfig

from twinkle.errors import InvalidRequest
from twinkle.types import LoraSpec

DEFAULT_ALPHA = 32.0
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def target_modules(spec: LoraSpec, unembed_module: str) -> list[str] | str:
    """Explicit modules win; otherwise the train_attn / train_mlp / train_unembed flags pick them.

    `all-linear` is PEFT's meaning: every linear layer except the output head.
    """
    if spec.target_modules is not None:
        if spec.target_modules == "all-linear":
            return "all-linear"
        if isinstance(spec.target_modules, str):
            return [spec.target_modules]
        return list(spec.target_modules)
    modules: list[str] = []
    if spec.train_attn:
        modules.extend(ATTENTION_MODULES)
    if spec.train_mlp:
        modules.extend(MLP_MODULES)
    if spec.train_unembed:
        modules.append(unembed_module)
    return modules


def lora_config(
    spec: LoraSpec, *, base_model_name: str, unembed_module: str = "lm_head", exclude_modules: str | None = None
) -> LoraConfig:
    """A trainable LoraConfig; raises InvalidRequest for values PEFT would reject or misuse.

    `exclude_modules` (a regex over full module names) keeps LoRA off modules the targets would also match,
    such as a vision tower's `q_proj`.
    """
    problems = []
    if spec.rank < 1:
        problems.append(f"rank must be >= 1, got {spec.rank}")
    if spec.alpha is not None and spec.alpha <= 0:
        problems.append(f"alpha must be > 0, got {spec.alpha}")
    if not 0 <= spec.dropout < 1:
        problems.append(f"dropout must be in [0, 1), got {spec.dropout}")
    modules = target_modules(spec, unembed_module)
    if not modules:
        problems.append("no target modules: set target_modules or one of train_attn, train_mlp, train_unembed")
    if problems:
        raise InvalidRequest("Invalid LoRA config: " + "; ".join(problems) + ".")
    return LoraConfig(
        r=spec.rank,
        # Typed int by PEFT, but only ever used in alpha / rank: fractional alphas work.
        lora_alpha=cast(int, DEFAULT_ALPHA if spec.alpha is None else spec.alpha),
        lora_dropout=spec.dropout,
        target_modules=modules,
        exclude_modules=exclude_modules,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name,
        inference_mode=False,
    )


def lora_spec_from_config(config: LoraConfig) -> LoraSpec:
    """The LoraSpec that rebuilds an adapter with the same shapes (for creating a model from a checkpoint)."""
    modules = config.target_modules
    targets: tuple[str, ...] | str
    if isinstance(modules, str):
        targets = modules
    else:
        # PEFT stores resolved `all-linear` targets as full module paths; the last segment matches them all.
        targets = tuple(sorted({name.rsplit(".", 1)[-1] for name in modules or ()}))
    return LoraSpec(
        rank=int(config.r),
        alpha=float(config.lora_alpha),
        dropout=float(config.lora_dropout),
        target_modules=targets,
    )
