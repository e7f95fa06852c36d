"""What one tenant owns besides its LoRA weights: optimizer, step counter and random stream."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from twinkle.errors import InvalidRequest, LimitExceeded, NotFound
from twinkle.types import AdamParams, LoraSpec


@dataclass
class RngState:
    """A tenant's own random stream (LoRA dropout), so tenants interleaving on one process stay reproducible."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None

    @classmethod
    def seeded(cls, seed: int, device: torch.device) -> RngState:
        with torch.random.fork_rng(devices=_cuda_devices(device)):
            torch.manual_seed(seed)
            cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            return cls(torch.get_rng_state(), cuda)

    @contextmanager
    def active(self, device: torch.device) -> Iterator[None]:
        """Draw from this stream inside the block and remember where it stopped; the global one is untouched."""
        with torch.random.fork_rng(devices=_cuda_devices(device)):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None and device.type == "cuda":
                torch.cuda.set_rng_state(self.cuda, device)
            yield
            self.cpu = torch.get_rng_state()
            if device.type == "cuda":
                self.cuda = torch.cuda.get_rng_state(device)

    def to_dict(self) -> dict[str, torch.Tensor | None]:
        return {"cpu": self.cpu, "cuda": self.cuda}

    @classmethod
    def from_dict(cls, state: dict[str, torch.Tensor | None]) -> RngState:
        cpu = state["cpu"]
        assert cpu is not None
        return cls(cpu, state.get("cuda"))


def _cuda_devices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@dataclass
class Tenant:
    """One adapter id's training state on the shared model."""

    adapter_id: str
    name: str  # the PEFT adapter name
    spec: LoraSpec
    seed: int
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    rng: RngState
    steps: int = 0

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


class TenantSlots:
    """The tenants of one replica by adapter id, at most `max_loras` of them, each with a fresh adapter name."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise InvalidRequest(f"max_loras must be at least 1, got {max_loras}.")
        self.max_loras = max_loras
        self._by_id: dict[str, Tenant] = {}
        self._names = (f"tenant_{number}" for number in itertools.count())

    def reserve(self, adapter_id: str) -> str:
        """The adapter name for a new tenant; raises while the id exists or every slot is taken."""
        if adapter_id in self._by_id:
            raise InvalidRequest(f"Adapter {adapter_id} already exists on this replica.")
        if len(self._by_id) >= self.max_loras:
            raise LimitExceeded(
                f"All {self.max_loras} LoRA slots of this replica are in use ({len(self._by_id)} adapters).",
                hint="Unload an adapter or wait for idle ones to expire.",
                max_loras=self.max_loras,
            )
        return next(self._names)

    def add(self, tenant: Tenant) -> None:
        self._by_id[tenant.adapter_id] = tenant

    def pop(self, adapter_id: str) -> Tenant | None:
        """Forget the tenant, its gradients released; None for an unknown id."""
        tenant = self._by_id.pop(adapter_id, None)
        if tenant is not None:
            tenant.zero_grad()
        return tenant

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._by_id

    def __getitem__(self, adapter_id: str) -> Tenant:
        tenant = self._by_id.get(adapter_id)
        if tenant is None:
            raise NotFound(f"No adapter {adapter_id} on this replica.", hint="Create the model first.")
        return tenant


def new_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay; its hyper-parameters are overwritten by every optim_step."""
    defaults = AdamParams()
    return torch.optim.AdamW(
        params,
        lr=defaults.learning_rate,
        betas=(defaults.beta1, defaults.beta2),
        eps=defaults.eps,
        weight_decay=defaults.weight_decay,
    )


def check_adam_params(params: AdamParams) -> None:
    problems = []
    if not params.learning_rate >= 0:
        problems.append(f"learning_rate must be >= 0, got {params.learning_rate}")
    for name, beta in (("beta1", params.beta1), ("beta2", params.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{name} must be in [0, 1), got {beta}")
    for name, value in (("eps", params.eps), ("weight_decay", params.weight_decay)):
        if not value >= 0:
            problems.append(f"{name} must be >= 0, got {value}")
    if not params.grad_clip_norm >= 0:
        problems.append(f"grad_clip_norm must be >= 0 (0 disables clipping), got {params.grad_clip_norm}")
    if problems:
        raise InvalidRequest("Invalid adam_params: " + "; ".join(problems) + ".")


def adam_step(tenant: Tenant, params: AdamParams) -> dict[str, float]:
    """Clip, step and zero the tenant's accumulated gradients; the grad norm is measured before clipping."""
    check_adam_params(params)
    grads = [param.grad for param in tenant.params if param.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if params.grad_clip_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(tenant.params, params.grad_clip_norm, norm)
    for group in tenant.optimizer.param_groups:
        group["lr"] = params.learning_rate
        group["betas"] = (params.beta1, params.beta2)
        group["eps"] = params.eps
        group["weight_decay"] = params.weight_decay
    tenant.optimizer.step()
    tenant.zero_grad()
    tenant.steps += 1
    return {"grad_norm:mean": float(norm), "learning_rate:mean": float(params.learning_rate)}
