"""One base model carrying many named LoRA adapters through a single PeftModel.

The PeftModel is made on the first adapter and kept afterwards (PEFT leaves empty LoRA wrappers when the last
adapter goes, which behave like the base layers). Only the active adapter's parameters require grad, so a
backward pass never touches another tenant's weights. On a vision-language model LoRA goes on the language
model and its output head only: the vision tower and projector stay as they are (`vision_modules`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import PreTrainedModel

from twinkle.backends.hf import fused_lora
from twinkle.backends.hf.loading import BaseModel, has_vision_tower

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" rows in a mixed batch


class SharedModel:
    """Adds, removes, activates and runs named LoRA adapters on one base model."""

    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self.peft: PeftModel | None = None
        self.unembed_module = _module_name(base.model, base.model.get_output_embeddings())
        self.vision_modules = _vision_modules(base.model) if has_vision_tower(base.model) else None
        # transformers renamed `past_key_values` to `cache` (5.2x); speak whichever this version understands.
        forward_parameters = inspect.signature(base.model.forward).parameters
        self.cache_argument = "cache" if "cache" in forward_parameters else "past_key_values"
        self.accepts_logits_to_keep = "logits_to_keep" in forward_parameters
        # What activate() and train() last set: both walk every module (about 3 ms a step on a small model),
        # so they are skipped when nothing changed. Anything else that changes either resets them to None.
        self._trainable: str | None = None
        self._training: bool | None = None

    @property
    def adapters(self) -> list[str]:
        return list(self.peft.peft_config) if self.peft is not None else []

    def has_adapter(self, name: str) -> bool:
        return self.peft is not None and name in self.peft.peft_config

    def add_adapter(self, name: str, config: LoraConfig, *, seed: int) -> None:
        """Inject a fresh adapter whose initial weights depend on `seed` only."""
        # PEFT initializes LoRA weights on the CPU before moving them, so seeding the CPU generator suffices.
        self._forget_modes()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base.model, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        self.activate(name)

    def load_adapter(self, name: str, directory: Path) -> None:
        """Add an adapter from a PEFT directory (adapter_config.json + weights), frozen, for inference.

        On failure (weights of another shape) nothing of the adapter stays behind.
        """
        self._forget_modes()
        if self.peft is None:
            # Wrap first and load second, so a failed load leaves a PeftModel we can remove the adapter from.
            config = LoraConfig.from_pretrained(str(directory))
            config.inference_mode = True
            self.peft = get_peft_model(self.base.model, config, adapter_name=name)
        try:
            self.peft.load_adapter(str(directory), adapter_name=name, is_trainable=False)
        except Exception:
            self.delete_adapter(name)
            raise
        self.peft.eval()

    def delete_adapter(self, name: str) -> None:
        self._forget_modes()
        if self.has_adapter(name):
            assert self.peft is not None
            others = [other for other in self.adapters if other != name]
            if self.peft.active_adapter == name and others:
                # Hand the active role on first, frozen, instead of letting PEFT warn and pick one.
                self.peft.set_adapter(others[0], inference_mode=True)
            self.peft.delete_adapter(name)

    def config(self, name: str) -> LoraConfig:
        assert self.peft is not None
        config = self.peft.peft_config[name]
        assert isinstance(config, LoraConfig)
        return config

    def parameters(self, name: str) -> list[nn.Parameter]:
        """The adapter's parameters in a fixed order (the model's), so optimizer states line up on reload."""
        assert self.peft is not None
        marker = f".{name}."
        return [param for key, param in self.peft.named_parameters() if marker in f"{key}."]

    def activate(self, name: str) -> None:
        """Make `name` the adapter that runs and the only one that requires grad."""
        assert self.peft is not None
        if self._trainable == name and self.peft.active_adapter == name:
            return
        self.peft.set_adapter(name)
        self._trainable = name

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's weights under PEFT's file keys (adapter name removed)."""
        assert self.peft is not None
        return get_peft_model_state_dict(self.peft, adapter_name=name, save_embedding_layers=False)

    def load_state_dict(self, name: str, state: dict[str, torch.Tensor]) -> None:
        assert self.peft is not None
        with torch.no_grad():
            set_peft_model_state_dict(self.peft, state, adapter_name=name)

    @contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Run the plain base model (the reference policy) inside this block."""
        if self.peft is None or not self.adapters:
            yield
            return
        with self.peft.disable_adapter():
            yield

    def __call__(self, adapter_names: Sequence[str] | None = None, **model_inputs: Any) -> Any:
        """Run the model: with the active adapter, or per row with `adapter_names` (inference only)."""
        if adapter_names is None or self.peft is None or not self.adapters:
            if adapter_names is not None and any(name != BASE_ADAPTER for name in adapter_names):
                raise ValueError(f"unknown adapters in {sorted(set(adapter_names))}")
            return self.base.model(**model_inputs)
        # Per row (hf.fused_lora): one gathered batched matmul per LoRA layer whatever the mix of adapters and
        # rows; PEFT's mixed-batch path (a loop over the batch's adapters) stays for what routing cannot serve.
        if fused_lora.unsupported(self.peft, adapter_names) is None:
            unknown = set(adapter_names) - set(self.adapters) - {BASE_ADAPTER}
            if unknown:
                raise ValueError(f"unknown adapters in {sorted(unknown)}")
            with fused_lora.routed(self.peft, list(adapter_names)):
                return self.base.model(**model_inputs)
        # The forward hooks that route rows to adapters only install while some adapter is active.
        if self.peft.active_adapter not in self.peft.peft_config:
            self._trainable = None
            self.peft.set_adapter(self.adapters[0], inference_mode=True)
        return self.peft(adapter_names=list(adapter_names), **model_inputs)

    def kv_cache(self, output: Any) -> Any:
        """The KV cache a forward with use_cache=True returned."""
        return getattr(output, self.cache_argument)

    def train(self, mode: bool) -> None:
        if self._training is mode:
            return
        (self.peft if self.peft is not None else self.base.model).train(mode)
        self._training = mode

    def _forget_modes(self) -> None:
        self._trainable = None
        self._training = None


def _module_name(model: nn.Module, target: nn.Module | None) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name.rsplit(".", 1)[-1]
    return "lm_head"


def _vision_modules(model: PreTrainedModel) -> str | None:
    """A regex (PEFT's `exclude_modules`) matching every module outside the language model and output head.

    It names the largest such subtrees (e.g. `model.vision_tower`, `model.multi_modal_projector`), so it
    stays short however deep the vision tower is.
    """
    kept = [module for module in (model.get_decoder(), model.get_output_embeddings()) if module is not None]
    if not kept or any(module is model for module in kept):
        return None
    kept_names = {name for name, module in model.named_modules() if any(module is other for other in kept)}
    prefixes: list[str] = []
    for name, module in model.named_modules():
        if not name or name in kept_names or next(module.parameters(), None) is None:
            continue
        inside_kept = any(name.startswith(f"{kept_name}.") for kept_name in kept_names)
        holds_kept = any(kept_name.startswith(f"{name}.") for kept_name in kept_names)
        parent_listed = any(name.startswith(f"{prefix}.") for prefix in prefixes)
        if not (inside_kept or holds_kept or parent_listed):
            prefixes.append(name)
    if not prefixes:
        return None
    return "(?:" + "|".join(re.escape(prefix) for prefix in prefixes) + r")(?:\..*)?"
