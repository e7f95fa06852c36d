"""A tenant's adapter on disk in the transformers backend's format, so checkpoints move between backends.

The files are the ones `twinkle.backends.hf.checkpoint` writes: PEFT's adapter_model.safetensors and
adapter_config.json, plus optimizer.pt (a torch AdamW state_dict over the adapter's parameters in PEFT's
order), trainer_state.json and rng_state.pt. Tensor-parallel shards are gathered into full tensors before
writing and split again after reading; only the first rank writes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from twinkle.backends.hf.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    OPTIMIZER_STATE,
    RNG_STATE,
    TRAINER_STATE,
)
from twinkle.backends.hf.tenant import RngState, Tenant, new_optimizer
from twinkle.backends.megatron.lora_layout import LoraTarget, megatron_to_peft, peft_to_megatron
from twinkle.backends.megatron.weight_layout import Split, shard, unshard
from twinkle.errors import InvalidRequest

Tensor = torch.Tensor
FORMAT = "twinkle-megatron-1"


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank sits among the tensor-parallel ranks, and how each adapter tensor is split."""

    rank: int
    size: int
    group: Any
    splits: Mapping[str, Split]  # Megatron LoRA key → split
    writer: bool  # whether this process writes the files

    def gather(self, key: str, local: Tensor) -> Tensor:
        """The full tensor of `key` from every rank's shard (a collective: every rank must call it)."""
        if self.size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return unshard(pieces, self.splits[key])

    def local(self, key: str, full: Tensor) -> Tensor:
        return shard(full, self.splits[key], self.rank, self.size)


# Adapter weights


def save_adapter(
    directory: Path,
    local_state: Mapping[str, Tensor],
    targets: Sequence[LoraTarget],
    config: LoraConfig,
    layout: ShardLayout,
) -> None:
    full = {
        key: layout.gather(key, value).detach().to("cpu").contiguous() for key, value in local_state.items()
    }
    if not layout.writer:
        return
    directory.mkdir(parents=True, exist_ok=True)
    save_file(megatron_to_peft(full, targets), str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    saved = copy.deepcopy(config)
    saved.inference_mode = True
    saved.save_pretrained(str(directory))


def read_adapter(
    directory: Path, targets: Sequence[LoraTarget], current: LoraConfig, layout: ShardLayout
) -> dict[str, Tensor]:
    """This rank's Megatron-named shards of a saved adapter; InvalidRequest when it does not fit `current`."""
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (directory / name).is_file()]
    if missing:
        raise InvalidRequest(
            f"{directory.name} is not an adapter checkpoint: {', '.join(missing)} missing.",
            hint="Pass a path written by save_state or save_weights_for_sampler.",
        )
    config = LoraConfig.from_pretrained(str(directory))
    if int(config.r) != int(current.r) or float(config.lora_alpha) != float(current.lora_alpha):
        raise InvalidRequest(
            f"The checkpoint's LoRA adapter (rank {config.r}, alpha {config.lora_alpha}) does not fit this "
            f"model's adapter (rank {current.r}, alpha {current.lora_alpha}).",
            hint="Create the model with the checkpoint's LoRA config before loading it.",
        )
    full = peft_to_megatron(load_file(str(directory / ADAPTER_WEIGHTS)), targets)
    return {key: layout.local(key, value) for key, value in full.items()}


# Training state


def save_training_state(tenant: Tenant, directory: Path, keys: Sequence[str], layout: ShardLayout) -> None:
    """optimizer.pt with full tensors in the transformers backend's layout, plus step counter and RNG."""
    state = tenant.optimizer.state_dict()
    full_state = {
        index: {name: _gathered(layout, keys[index], name, value) for name, value in slot.items()}
        for index, slot in state["state"].items()
    }
    if not layout.writer:
        return
    torch.save({"state": full_state, "param_groups": state["param_groups"]}, directory / OPTIMIZER_STATE)
    torch.save(tenant.rng.to_dict(), directory / RNG_STATE)
    trainer = {"format": FORMAT, "adapter_id": tenant.adapter_id, "steps": tenant.steps, "seed": tenant.seed}
    (directory / TRAINER_STATE).write_text(json.dumps(trainer, indent=2))


def load_training_state(
    tenant: Tenant, directory: Path, keys: Sequence[str], layout: ShardLayout, device: torch.device
) -> None:
    """Restore optimizer moments (this rank's shards), step counter and random stream exactly as saved."""
    missing = [
        name for name in (OPTIMIZER_STATE, TRAINER_STATE, RNG_STATE) if not (directory / name).is_file()
    ]
    if missing:
        raise InvalidRequest(
            f"The checkpoint has no optimizer state (missing {', '.join(missing)}).",
            hint="Load it without the optimizer, or save it with the optimizer.",
        )
    saved = torch.load(directory / OPTIMIZER_STATE, map_location="cpu", weights_only=True)
    local = {
        index: {
            name: value if value.dim() == 0 else layout.local(keys[int(index)], value).to(device)
            for name, value in slot.items()
        }
        for index, slot in saved["state"].items()
    }
    optimizer = new_optimizer(tenant.params)
    optimizer.load_state_dict({"state": local, "param_groups": saved["param_groups"]})
    tenant.optimizer = optimizer
    tenant.rng = RngState.from_dict(torch.load(directory / RNG_STATE, map_location="cpu", weights_only=True))
    tenant.steps = int(json.loads((directory / TRAINER_STATE).read_text())["steps"])


def _gathered(layout: ShardLayout, key: str, name: str, value: Any) -> Any:
    """A moment tensor gathered like its parameter; the scalar step count as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    return layout.gather(key, value).to("cpu")
