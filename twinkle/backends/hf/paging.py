"""A tenant's whole training state in host memory, and back: what paging an adapter out of its slot moves.

Weights, accumulated gradients and the AdamW state (moments, step, hyper-parameters) are copied to the CPU
tensor by tensor; the random stream already lives there. Restoring writes them into a PEFT adapter of the
same shape, whose parameters come in the same order, so the optimizer state lines up and training continues
bit-identically.

Adding a PEFT adapter walks the whole model (tens of ms even on a tiny one), so a paged-out tenant's PEFT
adapter is kept as a spare slot: the next page-in of an adapter with the same LoRA shape writes its state
into it. Spares and resident tenants together never exceed max_loras PEFT adapters on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from twinkle.backends.hf.tenant import RngState, Tenant, new_optimizer
from twinkle.backends.paging import PagedAdapter
from twinkle.types import LoraSpec

CPU = torch.device("cpu")
T = TypeVar("T", bound=tuple[Any, ...])


@dataclass
class HostTenant:
    """A paged-out tenant: everything but its PEFT modules, on the CPU."""

    spec: LoraSpec
    seed: int
    steps: int
    weights: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    optimizer: dict[str, Any]
    rng: RngState

    # Pickled (paging to disk) as raw bytes in numpy arrays: pickling a torch tensor costs ~0.4 ms, a numpy
    # array microseconds, and an adapter has a few hundred tensors.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "weights": [_pack(w) for w in self.weights],
                "grads": [None if g is None else _pack(g) for g in self.grads],
                "optimizer": _map_tensors(self.optimizer, _pack)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, weights=[_unpack(w) for w in state["weights"]],
                             grads=[None if g is None else _unpack(g) for g in state["grads"]],
                             optimizer=_map_tensors(state["optimizer"], _unpack, packed=True))


def host_copy(tenant: Tenant) -> PagedAdapter:
    """The tenant's state on the CPU. On a CPU model gradients and optimizer moments are handed over, not
    copied: the tenant's optimizer and gradients are dropped right after, so nothing else writes them."""
    # weights copied even on a CPU model: the PEFT adapter they live in is reused by the next page-in
    weights = [param.detach().to(CPU, copy=True) for param in tenant.params]
    grads = [None if param.grad is None else param.grad.detach().to(CPU) for param in tenant.params]
    optimizer = _to_cpu(tenant.optimizer.state_dict())
    host = HostTenant(tenant.spec, tenant.seed, tenant.steps, weights, grads, optimizer, tenant.rng)
    tensors = [*weights, *(grad for grad in grads if grad is not None), *_tensors(optimizer["state"])]
    return PagedAdapter(host, sum(tensor.numel() * tensor.element_size() for tensor in tensors))


def restore(adapter_id: str, name: str, params: list[nn.Parameter], paged: PagedAdapter,
            device: torch.device) -> Tenant:
    """The tenant rebuilt on the PEFT adapter `name` (a spare, or freshly added) whose parameters are `params`."""
    host: HostTenant = paged.state
    if len(params) != len(host.weights):
        raise RuntimeError(f"adapter {adapter_id} came back with {len(params)} tensors, not {len(host.weights)}")
    with torch.no_grad():
        for param, weight in zip(params, host.weights, strict=True):
            param.copy_(weight)
    for param, grad in zip(params, host.grads, strict=True):
        param.grad = None if grad is None else grad.to(device, copy=True)
    optimizer = new_optimizer(params)
    optimizer.load_state_dict(host.optimizer)  # casts the moments to each parameter's device and dtype
    return Tenant(adapter_id, name, host.spec, host.seed, params, optimizer, host.rng, host.steps)


class SpareSlots:
    """PEFT adapter names free for reuse, by the LoRA shape they were built with (the spec without its seed,
    which only decides initial weights)."""

    def __init__(self) -> None:
        # name -> (shape, parameters): the parameter list saves a walk over the whole model per page-in
        self._spares: dict[str, tuple[LoraSpec, list[nn.Parameter]]] = {}

    def __len__(self) -> int:
        return len(self._spares)

    def keep(self, tenant: Tenant) -> None:
        self._spares[tenant.name] = (replace(tenant.spec, seed=None), tenant.params)

    def take(self, spec: LoraSpec) -> tuple[str, list[nn.Parameter]] | None:
        """A spare of this shape (its name and parameters), no longer a spare; None when there is none."""
        shape = replace(spec, seed=None)
        name = next((name for name, (other, _) in self._spares.items() if other == shape), None)
        if name is None:
            return None
        return name, self._spares.pop(name)[1]

    def pop_any(self) -> str | None:
        """The oldest spare's name, no longer a spare; None when there is none."""
        name = next(iter(self._spares), None)
        if name is not None:
            del self._spares[name]
        return name


def slot_sized(calls: Sequence[T], slots: int) -> list[list[T]]:
    """Consecutive parts of (adapter_id, ...) calls, each naming at most `slots` adapters: what one fused
    pass can hold in the LoRA slots at once."""
    parts: list[list[T]] = []
    adapters: set[str] = set()
    for call in calls:
        adapter_id = call[0]
        if not parts or (adapter_id not in adapters and len(adapters) >= slots):
            parts.append([])
            adapters = set()
        parts[-1].append(call)
        adapters.add(adapter_id)
    return parts


def _to_cpu(value: Any) -> Any:
    return _map_tensors(value, lambda tensor: tensor.detach().to(CPU))


def _map_tensors(value: Any, change: Any, *, packed: bool = False) -> Any:
    """`value` with every tensor (or, `packed`, every packed tensor) replaced by `change(it)`."""
    if isinstance(value, _PackedTensor if packed else torch.Tensor):
        return change(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, change, packed=packed) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_tensors(item, change, packed=packed) for item in value]
    return value


@dataclass
class _PackedTensor:
    data: np.ndarray  # the tensor's bytes
    dtype: torch.dtype
    shape: tuple[int, ...]


def _pack(tensor: torch.Tensor) -> _PackedTensor:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return _PackedTensor(raw.numpy(), tensor.dtype, tuple(tensor.shape))


def _unpack(packed: _PackedTensor) -> torch.Tensor:
    return torch.from_numpy(packed.data).view(packed.dtype).reshape(packed.shape)


def _tensors(state: dict[Any, dict[str, Any]]) -> list[torch.Tensor]:
    return [value for slot in state.values() for value in slot.values() if isinstance(value, torch.Tensor)]
