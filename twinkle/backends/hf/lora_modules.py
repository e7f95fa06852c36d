"""The linear layers of a loaded base model that a LoRA adapter can sit on, with their shapes.

A pool publishes them once its model is loaded (`workers.pool`); the API checks an imported adapter's tensors
against them (`twinkle.adapter_import`) without loading the model itself. Names are the model's own module
names, as PEFT's adapter files use them after `base_model.model.`; a vision-language model's vision tower is
left out, as the backend's adapters leave it out.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from twinkle.backends.hf.shared_model import SharedModel


def lora_module_shapes(shared: SharedModel) -> dict[str, Any]:
    """{"modules": {name: [out_features, in_features]}, "unembed": the output head's name}."""
    excluded = re.compile(shared.vision_modules) if shared.vision_modules else None
    modules: dict[str, list[int]] = {}
    for name, module in shared.base.model.named_modules():
        parts = name.split(".")
        if not name or parts[-1] == "base_layer" or any(part.startswith("lora_") for part in parts):
            continue  # PEFT's wrappers of adapted layers: the layer itself is reported under its own name
        layer = getattr(module, "base_layer", module)
        if isinstance(layer, nn.Linear) and not (excluded is not None and excluded.fullmatch(name)):
            modules[name] = [int(layer.out_features), int(layer.in_features)]
    return {"modules": modules, "unembed": shared.unembed_module}


def published_shapes(holder: Any) -> dict[str, Any] | None:
    """The shapes of the model a backend or sampler holds in this process; None when it holds no transformers
    model here (mock, megatron, vLLM, a data-parallel device group)."""
    shared = getattr(holder, "shared", None)
    return lora_module_shapes(shared) if isinstance(shared, SharedModel) else None
