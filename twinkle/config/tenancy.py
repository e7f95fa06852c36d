"""Tenants' shares and limits: tiers with a scheduling weight and quotas, and the usage meter's settings."""

from __future__ import annotations

from pydantic import Field

from twinkle.config.base import StrictModel


class QuotaConfig(StrictModel):
    """Limits on one metered quantity (see `twinkle.usage.METRICS`); 0 means no limit."""

    day: int = Field(default=0, ge=0)
    """Most of it per UTC day."""
    month: int = Field(default=0, ge=0)
    """Most of it per UTC calendar month."""
    total: int = Field(default=0, ge=0)
    """Most of it ever."""


class TierConfig(StrictModel):
    """What the keys of one tier get."""

    weight: float = Field(default=1.0, gt=0, le=1000)
    """Share of each pool's compute when tenants wait at once: weight 2 gets twice the tokens of weight 1."""
    quotas: dict[str, QuotaConfig] = Field(default_factory=dict)
    """Quotas per metered quantity, by its name (`trained_tokens`, `sampled_tokens`, `pool_ms`, ...)."""
    max_training_runs: int = Field(default=0, ge=0)
    """Training runs (LoRA models) one key may have active at once (0 = no limit beyond the pool's)."""


class TenancyConfig(StrictModel):
    """Tiers of API keys. A key's tier (and an optional weight of its own) is set in the keys file."""

    default_tier: str = "default"
    """The tier of keys that name none."""
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {"default": TierConfig()})
    """The tiers by name."""


class UsageConfig(StrictModel):
    """Exact usage metering per key and run (`GET /api/v1/usage`, the console's usage page)."""

    enabled: bool = True
    """Record what every op used."""
    prices: dict[str, float] = Field(default_factory=dict)
    """Price per unit of each metered quantity (e.g. `trained_tokens: 0.000002`); reports add a cost column."""
    currency: str = "USD"
    """The unit prices are in."""
