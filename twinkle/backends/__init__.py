"""Backend and sampler registries: config names to lazily imported classes.

Backends are imported only when a pool builds one, so the API and the mock backend never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from twinkle.errors import InvalidRequest

BACKENDS: dict[str, str] = {
    "mock": "twinkle.backends.mock:MockBackend",
    "transformers": "twinkle.backends.transformers_backend:TransformersBackend",
    "megatron": "twinkle.backends.megatron_backend:MegatronBackend",
}

SAMPLERS: dict[str, str] = {
    "mock": "twinkle.samplers.mock:MockSampler",
    "torch": "twinkle.samplers.torch_sampler:TorchSampler",
    "vllm": "twinkle.samplers.vllm_sampler:VLLMSampler",
}

# The sampler a model pool uses for checkpoint sampling when its config names none.
DEFAULT_SAMPLER_FOR_BACKEND: dict[str, str] = {"mock": "mock", "transformers": "torch", "megatron": "torch"}


def resolve(registry: dict[str, str], name: str, what: str) -> Any:
    if name not in registry:
        raise InvalidRequest(f"Unknown {what} {name!r}.", hint=f"Choose one of: {', '.join(sorted(registry))}.")
    module_name, _, attr = registry[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)
