"""An adapter checkpoint on disk: PEFT files any PeftModel can load, plus the tenant's training state.

A full run's checkpoint (`hf.full_run`, marked by `twinkle.full_checkpoint`) is a whole model and is refused here.
The training-state files below are shared with it.

adapter_model.safetensors, adapter_config.json    the LoRA weights and config (plain PEFT layout)
optimizer.pt                                      the optimizer's state_dict      (with optimizer)
trainer_state.json                                step counter and seed           (with optimizer)
rng_state.pt                                      the tenant's random stream      (with optimizer)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from twinkle import full_checkpoint
from twinkle.backends.hf.lora import lora_spec_from_config
from twinkle.backends.hf.shared_model import SharedModel
from twinkle.backends.hf.tenant import RngState, Tenant, new_optimizer
from twinkle.errors import InvalidRequest
from twinkle.types import LoraSpec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.pt"
FORMAT = "twinkle-transformers-1"


def save_adapter(shared: SharedModel, name: str, directory: Path) -> None:
    """Write the adapter's weights and config as PeftModel.from_pretrained expects them."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {key: value.detach().to("cpu").contiguous() for key, value in shared.state_dict(name).items()}
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(shared.config(name))
    config.inference_mode = True
    config.save_pretrained(str(directory))


def save_training_state(tenant: Tenant, directory: Path) -> None:
    torch.save(tenant.optimizer.state_dict(), directory / OPTIMIZER_STATE)
    torch.save(tenant.rng.to_dict(), directory / RNG_STATE)
    state = {"format": FORMAT, "adapter_id": tenant.adapter_id, "steps": tenant.steps, "seed": tenant.seed}
    (directory / TRAINER_STATE).write_text(json.dumps(state, indent=2))


def read_lora_spec(directory: Path) -> LoraSpec:
    """The LoraSpec to create an adapter that this checkpoint loads into (for creating a model from it)."""
    return lora_spec_from_config(_read_config(directory))


def load_adapter(shared: SharedModel, tenant: Tenant, directory: Path) -> None:
    """Replace the tenant's LoRA weights; raise InvalidRequest when the checkpoint's shapes do not fit."""
    config = _read_config(directory)
    state = load_file(str(directory / ADAPTER_WEIGHTS))
    expected = shared.state_dict(tenant.name)
    current = shared.config(tenant.name)
    mismatched = sorted(
        set(expected) ^ set(state)
        | {key for key in expected if key in state and state[key].shape != expected[key].shape}
    )
    if mismatched or float(config.lora_alpha) != float(current.lora_alpha):
        raise InvalidRequest(
            f"The checkpoint's LoRA adapter (rank {config.r}, alpha {config.lora_alpha}) does not fit this "
            f"model's adapter (rank {current.r}, alpha {current.lora_alpha}); "
            f"{len(mismatched)} weights differ in name or shape, e.g. {mismatched[:3]}.",
            hint="Create the model with the checkpoint's LoRA config before loading it.",
        )
    device_state = {key: value.to(expected[key].device, expected[key].dtype) for key, value in state.items()}
    shared.load_state_dict(tenant.name, device_state)


def load_training_state(tenant: Tenant, directory: Path, device: torch.device) -> None:
    """Restore optimizer moments, step counter and random stream exactly as saved."""
    missing = [name for name in (OPTIMIZER_STATE, TRAINER_STATE, RNG_STATE) if not (directory / name).is_file()]
    if missing:
        raise InvalidRequest(
            f"The checkpoint has no optimizer state (missing {', '.join(missing)}).",
            hint="Load it without the optimizer, or save it with the optimizer.",
        )
    optimizer = new_optimizer(tenant.params)
    optimizer.load_state_dict(torch.load(directory / OPTIMIZER_STATE, map_location=device, weights_only=True))
    tenant.optimizer = optimizer
    tenant.rng = RngState.from_dict(torch.load(directory / RNG_STATE, map_location="cpu", weights_only=True))
    trainer_state = json.loads((directory / TRAINER_STATE).read_text())
    tenant.steps = int(trainer_state["steps"])


def _read_config(directory: Path) -> LoraConfig:
    if full_checkpoint.is_full_checkpoint(directory):
        raise InvalidRequest(
            f"{directory.name} is a full-parameter checkpoint (a whole model, written by a full run), not a LoRA "
            "adapter.",
            hint="Create a full-parameter model (mode='full') and load it there.",
        )
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (directory / name).is_file()]
    if missing:
        raise InvalidRequest(
            f"{directory.name} is not an adapter checkpoint: {', '.join(missing)} missing.",
            hint="Pass a path written by save_state or save_weights_for_sampler.",
        )
    config = LoraConfig.from_pretrained(str(directory))
    if not isinstance(config, LoraConfig):
        raise InvalidRequest(f"{directory.name} holds a {type(config).__name__}, not a LoRA adapter.")
    return config
