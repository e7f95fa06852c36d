"""The contract every model backend and sampler fulfils.

A backend hosts one base model and many tenants' LoRA adapters, each keyed by the Twinkle model id.
It is driven by exactly one pool worker thread at a time, so implementations need no locking. Errors
the caller can fix are raised as `twinkle.errors.UserError` subclasses (usually `InvalidRequest`),
anything else propagates and is reported as a server error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from twinkle.types import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    ModelInfo,
    SampleOutput,
    SampleRequest,
)


class ModelBackend(Protocol):
    """Trains LoRA adapters on one shared base model, and (`LoraSpec.mode == "full"`) at most one full-parameter run
    of the base model's own weights under the same methods, keyed by its run id: while it lives the pool runs no
    other run's op (twinkle.pool_reservation), and removing it restores the base weights exactly."""

    info: ModelInfo

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        """Add a fresh adapter with its own optimizer state; raise LimitExceeded when no slot is free."""

    def remove_adapter(self, adapter_id: str) -> None:
        """Drop the adapter and everything it holds; unknown ids are ignored."""

    def has_adapter(self, adapter_id: str) -> bool: ...

    def forward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        """Loss and per-token outputs without touching gradients; with `batch.disable_lora`, those of the base
        model without the adapter."""

    def forward_backward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        """Like forward, and accumulate the gradients of the summed loss into the adapter."""

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        """Apply the accumulated gradients (clip, Adam step, zero); metrics keyed `name:reduction`,
        including `grad_norm:mean` measured before clipping."""

    def save_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        """Write the adapter (and optionally optimizer + step counters) into an existing empty dir."""

    def load_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        """Replace the adapter's weights (and optionally optimizer state) from `save_state` output.
        The adapter must exist already (create_adapter first)."""

    def save_weights_for_sampler(self, adapter_id: str, directory: Path) -> None:
        """Write only what a sampler needs to serve this adapter."""

    def sample(self, adapter_id: str | None, requests: list[SampleRequest]) -> list[SampleOutput]:
        """Sample with the adapter's current in-memory weights (None: the base model)."""


class SamplerBackend(Protocol):
    """Generates from the base model with adapters loaded from sampler checkpoints."""

    info: ModelInfo

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        """Serve a batch; each request names its adapter by `adapter_path` (None: base model)."""


# Optional capabilities: a backend or sampler has them or not, and the pool asks with isinstance.


@runtime_checkable
class FusedPasses(Protocol):
    """Runs several adapters' forward/backward calls as one pass (workers.clock)."""

    def run_fused(self, calls: list[tuple[str, ForwardBackwardInput, bool]]) -> list[Any]: ...


@runtime_checkable
class FusedEligibility(Protocol):
    """Says why one call cannot join a fused pass (None: it can)."""

    def fused_solo_reason(self, adapter_id: str, batch: ForwardBackwardInput) -> str | None: ...


@runtime_checkable
class GradientSync(Protocol):
    """Sums an adapter's (or a full run's) gradients over data-parallel ranks before its optimizer step."""

    def sync_gradients(self, adapter_id: str, reducer: Any) -> None: ...


@runtime_checkable
class ResidentSlots(Protocol):
    """Holds at most `resident_slots` adapters on the device at once, so a fused pass takes no more (workers.clock)."""

    @property
    def resident_slots(self) -> int: ...


@runtime_checkable
class ComputeDtype(Protocol):
    """Computes in a dtype of its own (`float32`, `bfloat16`, ...), which a merged export is checked against."""

    @property
    def compute_dtype(self) -> str: ...


@runtime_checkable
class PagedAdapters(Protocol):
    """Holds some adapters in device slots and pages the others out (backends.paging)."""

    def resident_adapters(self) -> list[str]: ...

    def paging_stats(self) -> dict[str, float]: ...


@runtime_checkable
class SharedBase(Protocol):
    """Holds its base model in this process, shared by its adapters (transformers backends and the torch sampler),
    whose linear layers imported adapters are checked against (twinkle.adapter_import)."""

    @property
    def shared(self) -> Any: ...


@runtime_checkable
class ContinuousSampling(Protocol):
    """Serves one continuous generation that takes new requests between decode steps (workers.batcher)."""

    def serve(self, take: Any) -> None: ...
