"""How a model pool gathers several tenants' ready ops into one "clock cycle" (`workers.clock`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from twinkle.config.base import StrictModel


class ClockConfig(StrictModel):
    """Fused multi-tenant passes: ready forward / forward_backward ops of different adapters run as one batch
    through the base model (per-row LoRA), ready optim_steps run back to back in one cycle.

    Off by default while it is new: it switches the pool's worker from one consumer thread to `max_ops`
    threads (one per op in hand), and an operator who sees a problem there turns it off here without losing
    anything else. Each adapter's ops still run in acceptance order and each gets exactly its solo result."""

    enabled: bool = False
    """Gather ready ops of different adapters into fused passes (transformers backend; other backends
    keep running one op at a time, still in order)."""
    window_ms: float = Field(default=5.0, ge=0, le=1000)
    """How long a cycle waits for ops already delivered to the pool but still being read from the broker."""
    max_ops: int = Field(default=16, ge=1, le=256)
    """Ops the pool holds at once (its Celery threads and prefetch), and so the most ops in one cycle."""
    max_tokens: int = Field(default=16384, ge=1)
    """Token budget of one fused pass (each op's rows x its longest row, summed); a larger op still runs, alone."""


class SchedulingConfig(StrictModel):
    """Which waiting op a model or sampler pool serves next (`workers.fair_share`)."""

    policy: Literal["fair", "fifo"] = "fair"
    """`fair`: weighted fair share between API keys, counted in tokens (a Virtual Token Counter), each adapter's
    ops still in acceptance order; `fifo`: arrival order, the way a plain queue serves."""
    window: int = Field(default=64, ge=1, le=512)
    """Ops the pool holds at once to choose from (the messages it takes off its queue, and where its clock chooses,
    its Celery threads).
    The wait bound holds among them: a tenant with more queued than the window leaves the rest queued in the
    broker, behind it."""
