"""Per-row LoRA routing: each row of one batch goes through its own adapter's A and B.

PEFT's own mixed-adapter path (`adapter_names=`) loops over the adapters of a batch, index-selects each
one's rows and runs them separately, and refuses to run while training. This module instead follows the
gathered batched matmul of Punica's BGMV kernel, in plain torch: per LoRA layer the adapters of the batch
are stacked into one zero-padded A [U+1, r_max, in] and scale·B [U+1, out, r_max] (slot 0 is "no adapter", all
zeros), each row gathers its own slot and two `torch.bmm` calls add `(x A^T) (scale·B)^T` to the base
layer's output. So

- rows of different ranks share one matmul (padding a rank with zero rows and columns adds exact zeros);
- an adapter that does not target a layer gets the zero slot there, as if the layer had no LoRA;
- the stacks are built from the adapters' own parameters inside autograd, so a backward pass through a
  routed batch sends each adapter exactly the gradient of its own rows (and nothing to an adapter whose
  parameters do not require grad);
- the number of kernels does not depend on how many adapters share the batch or how rows are ordered
  (decode steps interleave adapters freely).

LoRA dropout is not applied (callers route only adapters with dropout 0, or run in eval mode), nor are
DoRA/variants, LoRA biases or non-Linear LoRA layers: `unsupported` names what stands in the way.
PEFT still owns the adapters (creation, state dicts, checkpoints): only the forward is redirected, for
the duration of a `routed` block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

BASE_ROW = "__base__"  # a row that uses no adapter (PEFT's name for it in mixed batches)


def lora_layers(model: nn.Module) -> list[Any]:
    """PEFT's LoRA layers in `model` (typed Any: PEFT declares their ModuleDicts loosely)."""
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def unsupported(model: nn.Module, names: Sequence[str]) -> str | None:
    """Why these adapters cannot be routed per row on `model` (None when they can)."""
    wanted = {name for name in names if name != BASE_ROW}
    for module in lora_layers(model):
        present = wanted & set(module.lora_A.keys())
        if not present:
            continue
        if not isinstance(module, LoraLinear):
            return f"a {type(module).__name__} LoRA layer (only Linear layers are routed per row)"
        for name in present:
            if name in module.lora_variant:
                return f"adapter {name} uses a LoRA variant (DoRA)"
            if module.lora_B[name].bias is not None:
                return f"adapter {name} has a LoRA bias"
    return None


@contextmanager
def routed(model: nn.Module, row_names: Sequence[str]) -> Iterator[None]:
    """Inside this block every LoRA Linear of `model` sends row i of its input through adapter
    `row_names[i]` (BASE_ROW or an adapter the layer lacks: the base layer alone)."""
    names = sorted({name for name in row_names if name != BASE_ROW})
    slot_of = {name: slot for slot, name in enumerate(names, start=1)}
    slots = [slot_of.get(name, 0) for name in row_names]
    layers: list[Any] = [module for module in lora_layers(model) if isinstance(module, LoraLinear)]
    indices: dict[torch.device, torch.Tensor] = {}

    def rows_on(device: torch.device) -> torch.Tensor:
        if device not in indices:
            indices[device] = torch.tensor(slots, dtype=torch.long, device=device)
        return indices[device]

    for layer in layers:
        layer.forward = _routed_forward(layer, names, rows_on)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward


def _routed_forward(layer: Any, names: list[str], rows_on: Any) -> Any:
    present = [name for name in names if name in layer.lora_A]

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("adapter_names", None)
        result = layer.base_layer(x, *args, **kwargs)
        if not present:
            return result
        a_stack, b_stack = _stacks(layer, names, present)
        rows = rows_on(x.device)
        if x.shape[0] != rows.shape[0]:
            raise ValueError(f"routing {rows.shape[0]} rows, but the layer got {x.shape[0]}")
        flat = x.dim() == 2
        inputs = (x.unsqueeze(1) if flat else x.reshape(x.shape[0], -1, x.shape[-1])).to(a_stack.dtype)
        hidden = torch.bmm(inputs, a_stack[rows].transpose(1, 2))
        delta = torch.bmm(hidden, b_stack[rows].transpose(1, 2))
        return result + delta.reshape(result.shape).to(result.dtype)

    return forward


def _stacks(layer: Any, names: list[str], present: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A [U+1, r_max, in] and scale·B [U+1, out, r_max] of this layer; slot 0 and absent adapters are zeros.

    The LoRA scale is folded into the small B rather than applied to the [rows, T, out] product: on CPU
    that multiply and its backward cost as much as both matmuls."""
    first = layer.lora_A[present[0]].weight
    rank = max(int(layer.r[name]) for name in present)
    fan_in, fan_out = first.shape[1], layer.lora_B[present[0]].weight.shape[0]
    zero_a = first.new_zeros((rank, fan_in))
    zero_b = first.new_zeros((fan_out, rank))
    a_parts, b_parts = [zero_a], [zero_b]
    for name in names:
        if name not in layer.lora_A:
            a_parts.append(zero_a)
            b_parts.append(zero_b)
            continue
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight * layer.scaling[name]
        pad = rank - a.shape[0]
        a_parts.append(nn.functional.pad(a, (0, 0, 0, pad)) if pad else a)
        b_parts.append(nn.functional.pad(b, (0, pad)) if pad else b)
    return torch.stack(a_parts), torch.stack(b_parts)
