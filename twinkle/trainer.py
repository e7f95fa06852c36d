"""Server-side training configuration of one adapter, for Twinkle-native clients.

The Twinkle client configures a model by name (`set_loss('CrossEntropyLoss')`,
`set_optimizer('AdamW', lr=1e-4)`, `set_lr_scheduler('CosineAnnealingLR', T_max=100)`, ...) and then
just calls `forward_backward(inputs=batch)` and `clip_grad_and_step()`. Every name resolves through a
registry here, never through an import path, and an unknown name is a user error listing the valid
ones. The trainer turns those calls into backend ops: the configured loss, gradient accumulation
over `gradient_accumulation_steps` micro-batches, the scheduled learning rate and clipping. Its
state is saved in checkpoints (`twinkle_trainer.json`) so that resuming restores the schedule too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from twinkle.errors import InvalidRequest
from twinkle.hyperparameters import check_adam_params
from twinkle.types import AdamParams

# Twinkle class names and Tinker names, to the backend's loss names.
LOSSES: dict[str, str] = {
    "CrossEntropyLoss": "cross_entropy",
    "DPOLoss": "dpo",
    "GRPOLoss": "grpo",
    "PPOLoss": "ppo",
    "ImportanceSamplingLoss": "importance_sampling",
    "CISPOLoss": "cispo",
    "DROLoss": "dro",
    **{name: name for name in ("cross_entropy", "dpo", "grpo", "ppo", "importance_sampling", "cispo", "dro")},
}
OPTIMIZERS = ("Adam", "AdamW", "default")
LR_SCHEDULERS = ("ConstantLR", "LinearLR", "CosineAnnealingLR", "CosineWarmupLR", "default")
PROCESSORS = ("InputProcessor",)
OPTIMIZER_KWARGS = {"lr", "betas", "eps", "weight_decay"}
SCHEDULER_KWARGS = {
    "ConstantLR": {"factor", "total_iters"},
    "LinearLR": {"start_factor", "end_factor", "total_iters"},
    "CosineAnnealingLR": {"T_max", "eta_min"},
    "CosineWarmupLR": {"num_warmup_steps", "num_training_steps", "min_lr_ratio"},
    "default": {"lr_decay_steps", "max_lr", "min_lr", "lr_warmup_steps"},
}


def pick(name: str, valid: Any, what: str) -> str:
    if name not in valid:
        raise InvalidRequest(f"Unknown {what} {name!r}.", hint=f"Choose one of: {', '.join(valid)}.")
    return name


def check_kwargs(kwargs: dict[str, Any], allowed: set[str], what: str) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise InvalidRequest(f"Unknown {what} argument(s): {', '.join(unknown)}.",
                             hint=f"Accepted: {', '.join(sorted(allowed)) or 'none'}.")
    return kwargs


@dataclass
class TrainConfig:
    """What `get_train_configs()` shows and checkpoints keep."""

    gradient_accumulation_steps: int = 1
    loss: str = "CrossEntropyLoss"
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "AdamW"
    optimizer_kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-4})
    lr_scheduler: str | None = None
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    max_grad_norm: float = 1.0
    template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    processor: str = "InputProcessor"
    processor_kwargs: dict[str, Any] = field(default_factory=lambda: {"padding_side": "right"})

    def apply(self, changes: dict[str, Any]) -> None:
        """Validate and apply a `configure` request; nothing changes if any part is invalid."""
        updated = TrainConfig(**{**asdict(self)})
        for key, value in changes.items():
            if value is None:
                continue
            if key == "gradient_accumulation_steps":
                if int(value) < 1:
                    raise InvalidRequest("gradient_accumulation_steps must be at least 1.")
                updated.gradient_accumulation_steps = int(value)
            elif key == "loss":
                updated.loss = pick(value, LOSSES, "loss")
            elif key == "optimizer":
                updated.optimizer = pick(value, OPTIMIZERS, "optimizer")
            elif key == "optimizer_kwargs":
                updated.optimizer_kwargs = {**updated.optimizer_kwargs,
                                            **check_kwargs(value, OPTIMIZER_KWARGS, "optimizer")}
            elif key == "lr_scheduler":
                updated.lr_scheduler = pick(value, LR_SCHEDULERS, "lr scheduler")
            elif key == "lr_scheduler_kwargs":
                allowed = SCHEDULER_KWARGS.get(updated.lr_scheduler or "", set())
                updated.lr_scheduler_kwargs = check_kwargs(value, allowed, f"{updated.lr_scheduler} scheduler")
            elif key == "processor":
                updated.processor = pick(value, PROCESSORS, "processor")
            elif key == "max_grad_norm":
                updated.max_grad_norm = float(value)
            elif key in ("loss_kwargs", "template", "template_kwargs", "processor_kwargs"):
                setattr(updated, key, value)
            else:
                raise InvalidRequest(f"Unknown training setting {key!r}.")
        try:  # refuse lr=1e308 (or "abc") now rather than at the first step
            first_step = adam_params(updated, 0, None)
        except (TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
            raise InvalidRequest(f"The optimizer settings do not make a learning rate: {exc}.") from exc
        check_adam_params(first_step, "optimizer")
        self.__dict__.update(updated.__dict__)

    @property
    def backend_loss(self) -> str:
        return LOSSES[self.loss]


@dataclass
class TrainerState:
    """Counters and running metrics of one adapter."""

    micro_steps: int = 0  # forward_backward calls since the last optimizer step
    cur_step: int = 0  # optimizer steps taken
    consumed_train_samples: int = 0
    loss_sum: float = 0.0
    loss_tokens: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    last_lr: float = 0.0


def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based) under the configured schedule."""
    base = float(config.optimizer_kwargs.get("lr", 1e-4))
    kw = config.lr_scheduler_kwargs
    name = config.lr_scheduler
    if name in (None, "ConstantLR"):
        total = int(kw.get("total_iters", 0))
        return base * (float(kw.get("factor", 1.0)) if step < total else 1.0)
    if name == "LinearLR":
        start, end, total = float(kw.get("start_factor", 1 / 3)), float(kw.get("end_factor", 1.0)), \
            int(kw.get("total_iters", 5))
        frac = min(step, total) / total if total else 1.0
        return base * (start + (end - start) * frac)
    if name == "CosineAnnealingLR":
        t_max, eta_min = int(kw.get("T_max", 1000)), float(kw.get("eta_min", 0.0))
        return eta_min + (base - eta_min) * (1 + math.cos(math.pi * min(step, t_max) / t_max)) / 2
    if name == "CosineWarmupLR":
        warmup, total = int(kw.get("num_warmup_steps", 0)), int(kw.get("num_training_steps", 1000))
        floor = float(kw.get("min_lr_ratio", 0.0))
        if step < warmup:
            return base * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return base * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    # "default" (Megatron-style): warmup, then cosine decay from max_lr to min_lr over lr_decay_steps
    max_lr = float(kw.get("max_lr", base))
    min_lr = float(kw.get("min_lr", 0.0))
    warmup = int(kw.get("lr_warmup_steps", 0))
    decay = int(kw.get("lr_decay_steps", 1000))
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay))
    return min_lr + (max_lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def adam_params(config: TrainConfig, step: int, max_grad_norm: float | None) -> AdamParams:
    kw = config.optimizer_kwargs
    betas = kw.get("betas", (0.9, 0.999))
    weight_decay = float(kw.get("weight_decay", 0.01 if config.optimizer in ("AdamW", "default") else 0.0))
    clip = config.max_grad_norm if max_grad_norm is None else max_grad_norm
    return AdamParams(learning_rate=learning_rate(config, step), beta1=float(betas[0]), beta2=float(betas[1]),
                      eps=float(kw.get("eps", 1e-8)), weight_decay=weight_decay, grad_clip_norm=float(clip or 0.0))
