"""Every tenant's LoRA weights on one Megatron model, added to its linear layers by forward hooks.

The base model is left as Megatron built it (its state-dict names stay the checkpoint's); a forward hook
on each targeted linear layer adds the active tenant's `scale · B(A(dropout(x)))` to the layer's output.
A fused layer gets one delta per HF projection, placed where that projection's rows sit in the fused
output (q/k/v interleaved by key/value group, gate then up), so each projection keeps its own LoRA pair
exactly as PEFT has it.

Tensor parallelism follows Megatron's own pattern for its linear layers. On a column-parallel layer the
input is whole and the output split: A is whole, B holds this rank's output rows, and A's output passes
`copy_to_region` (identity forward, all-reduce of the gradient backward) so A and the input get full
gradients. On a row-parallel layer the input is split: A holds this rank's input columns, and A's partial
output passes `reduce_from_region` (all-reduce forward) before the whole B. With one rank both are identity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from twinkle.backends.megatron.architecture import Architecture
from twinkle.backends.megatron.lora_layout import LoraTarget, key_splits, split_lora_state
from twinkle.backends.megatron.weight_layout import Split, interleave_groups

Tensor = torch.Tensor
RegionOp = Callable[[Tensor], Tensor]


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass(frozen=True)
class TensorParallelOps:
    """The two collectives the LoRA path needs; identity for a single tensor-parallel rank."""

    size: int = 1
    rank: int = 0
    copy_to_region: RegionOp = _identity
    reduce_from_region: RegionOp = _identity


@dataclass
class AdapterWeights:
    """One tenant's LoRA pairs on this rank, keyed by Megatron LoRA names."""

    targets: list[LoraTarget]
    scale: float
    dropout: float
    weights: dict[str, nn.Parameter]
    by_module: dict[str, list[tuple[LoraTarget, nn.Parameter, nn.Parameter]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for target in self.targets:
            a_key, b_key = target.megatron_keys
            self.by_module.setdefault(target.megatron_module, []).append(
                (target, self.weights[a_key], self.weights[b_key])
            )

    def parameters(self) -> list[nn.Parameter]:
        """A before B for each target, targets in PEFT's order: optimizer states line up with PEFT's."""
        return [self.weights[key] for target in self.targets for key in target.megatron_keys]


class AdapterBank:
    """Adds, removes, activates and applies named LoRA adapters on one Megatron GPTModel."""

    def __init__(
        self, model: nn.Module, arch: Architecture, parallel: TensorParallelOps | None = None
    ) -> None:
        self.arch = arch
        self.parallel = parallel or TensorParallelOps()
        self.training = False  # LoRA dropout applies only while training
        self._adapters: dict[str, AdapterWeights] = {}
        self._active: AdapterWeights | None = None
        modules = dict(model.named_modules())
        hooked = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
        self._handles = [
            module.register_forward_hook(partial(self._add_delta, name))
            for name, module in modules.items()
            if name.rsplit(".", 1)[-1] in hooked
        ]
        self._device = next(model.parameters()).device

    # Adapters

    def add(
        self, name: str, targets: Sequence[LoraTarget], *, rank: int, alpha: float, dropout: float, seed: int
    ) -> None:
        """A fresh adapter: A uniform in ±1/sqrt(fan_in) (PEFT's default), B zero, drawn from `seed` only."""
        generator = torch.Generator().manual_seed(seed)
        full: dict[str, Tensor] = {}
        for target in targets:
            a_key, b_key = target.megatron_keys
            fan_in, fan_out = self._full_shape(target)
            bound = 1.0 / math.sqrt(fan_in)
            full[a_key] = torch.empty(rank, fan_in).uniform_(-bound, bound, generator=generator)
            full[b_key] = torch.zeros(fan_out, rank)
        local = split_lora_state(full, targets, self.parallel.size)[self.parallel.rank]
        weights = {
            key: nn.Parameter(value.to(self._device, torch.float32).contiguous(), requires_grad=False)
            for key, value in local.items()
        }
        self._adapters[name] = AdapterWeights(list(targets), alpha / rank, dropout, weights)

    def remove(self, name: str) -> None:
        adapter = self._adapters.pop(name, None)
        if adapter is not None and self._active is adapter:
            self._active = None

    def adapter(self, name: str) -> AdapterWeights:
        return self._adapters[name]

    def activate(self, name: str) -> None:
        """Make `name` the adapter that runs and the only one whose weights require grad."""
        for other_name, other in self._adapters.items():
            for param in other.weights.values():
                param.requires_grad_(other_name == name)
        self._active = self._adapters[name]

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the plain base model (the reference policy) inside this block."""
        active, self._active = self._active, None
        try:
            yield
        finally:
            self._active = active

    def local_state(self, name: str) -> dict[str, Tensor]:
        """This rank's shards of the adapter's weights, Megatron-named, detached."""
        return {key: value.detach() for key, value in self._adapters[name].weights.items()}

    def load_local_state(self, name: str, state: Mapping[str, Tensor]) -> None:
        adapter = self._adapters[name]
        with torch.no_grad():
            for key, param in adapter.weights.items():
                param.copy_(state[key].to(param.device, param.dtype))

    def splits(self, name: str) -> dict[str, Split]:
        return dict(key_splits(self._adapters[name].targets))

    def _full_shape(self, target: LoraTarget) -> tuple[int, int]:
        """(in, out) features of the HF projection a target stands for, before any sharding."""
        arch = self.arch
        features = {
            "q_proj": (arch.hidden_size, arch.q_size),
            "k_proj": (arch.hidden_size, arch.kv_size),
            "v_proj": (arch.hidden_size, arch.kv_size),
            "o_proj": (arch.q_size, arch.hidden_size),
            "gate_proj": (arch.hidden_size, arch.ffn_hidden_size),
            "up_proj": (arch.hidden_size, arch.ffn_hidden_size),
            "down_proj": (arch.ffn_hidden_size, arch.hidden_size),
            "lm_head": (arch.hidden_size, arch.vocab_size),
        }
        return features[target.part]

    # The hook

    def _add_delta(self, module_name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        adapter = self._active
        pairs = adapter.by_module.get(module_name) if adapter is not None else None
        if not pairs:
            return None
        assert adapter is not None
        x = args[0]
        deltas = {target.part: self._delta(x, target, a, b, adapter) for target, a, b in pairs}
        out, bias = output
        return out + self._assemble(module_name, deltas, x.shape[:-1]).to(out.dtype), bias

    def _delta(self, x: Tensor, target: LoraTarget, a: Tensor, b: Tensor, adapter: AdapterWeights) -> Tensor:
        hidden = F.dropout(x.to(a.dtype), adapter.dropout, training=self.training and adapter.dropout > 0)
        hidden = hidden @ a.T
        if target.parallel == "column":
            hidden = self.parallel.copy_to_region(hidden)
        else:
            hidden = self.parallel.reduce_from_region(hidden)
        return (hidden @ b.T) * adapter.scale

    def _assemble(self, module_name: str, deltas: dict[str, Tensor], leading: torch.Size) -> Tensor:
        """One delta shaped like the layer's local output, each projection's part where its rows are."""
        arch, size = self.arch, self.parallel.size
        if module_name.endswith("linear_qkv"):
            widths = {
                "q_proj": arch.q_size // size,
                "k_proj": arch.kv_size // size,
                "v_proj": arch.kv_size // size,
            }
            parts = [self._part_or_zeros(deltas, part, width, leading) for part, width in widths.items()]
            return interleave_groups(parts, arch.num_kv_heads // size, dim=-1)
        if module_name.endswith("linear_fc1"):
            width = arch.ffn_hidden_size // size
            return torch.cat(
                [self._part_or_zeros(deltas, part, width, leading) for part in ("gate_proj", "up_proj")], -1
            )
        (delta,) = deltas.values()
        return delta

    @staticmethod
    def _part_or_zeros(deltas: dict[str, Tensor], part: str, width: int, leading: torch.Size) -> Tensor:
        if part in deltas:
            return deltas[part]
        reference = next(iter(deltas.values()))
        return reference.new_zeros(*leading, width)
