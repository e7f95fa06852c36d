"""Full-parameter fine-tuning on a model pool: off unless the operator allows it (twinkle.pool_reservation)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from twinkle.config.base import StrictModel


class FullFinetuneConfig(StrictModel):
    """Whether tenants may train all of the base model's weights on this pool, one run at a time, holding the
    pool exclusively while the run lives."""

    enabled: bool = False
    """Allow `create_model` with `training_mode: full` on this pool; LoRA runs are served as always."""
    while_reserved: Literal["wait", "refuse"] = "wait"
    """What other runs' ops do while a full run holds the pool: `wait` in the queue (their polls say until when),
    or `refuse`: fail at once with `pool_reserved` (HTTP 423), naming the time the reservation runs to."""
    lease_seconds: float = Field(default=120, gt=0)
    """Seconds without an op of the run or a heartbeat of its session after which the reservation ends and the
    run is unloaded (its checkpoints stay)."""
    max_hold_seconds: float = Field(default=0, ge=0)
    """Longest a full run may hold the pool, however active (0 = no limit)."""
    max_shard_size: str = Field(default="2GB", pattern=r"^\d+(\.\d+)?\s*[KMG]i?B$")
    """Largest safetensors file of a full run's checkpoint (`save_pretrained`'s max_shard_size): `500MB`, `2GB`."""
