"""Tenants' shares and limits: tiers with a scheduling weight and quotas, and the usage meter's settings."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from twinkle.config.base import StrictModel, config_problem
from twinkle.tenancy import TIER_NAME
from twinkle.usage import METRICS


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

    @field_validator("quotas")
    @classmethod
    def _quotas_name_metered_quantities(cls, quotas: dict[str, QuotaConfig]) -> dict[str, QuotaConfig]:
        for name in quotas:
            if name not in METRICS:
                raise config_problem(f"{name!r} is not a metered quantity", subpath=name,
                                     hint="set quotas on " + ", ".join(METRICS))
        return quotas


class TenancyConfig(StrictModel):
    """Tiers of API keys. A key's tier (and an optional weight of its own) is set in the keys file."""

    default_tier: str = "default"
    """The tier of keys that name none."""
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {"default": TierConfig()})
    """The tiers by name."""

    @model_validator(mode="after")
    def _tiers_are_nameable(self) -> TenancyConfig:
        for name in self.tiers:
            if not TIER_NAME.match(name):
                raise config_problem(f"{name!r} cannot be named in a keys file", subpath=f"tiers.{name}",
                                     hint="name a tier with 1-64 letters, digits and . _ -")
        if self.default_tier not in self.tiers:
            raise config_problem(f"{self.default_tier!r} is not one of the tiers", subpath="default_tier",
                                 hint="define it under tenancy.tiers, or pick one of: "
                                 + (", ".join(self.tiers) or "(no tiers are defined)"))
        return self


class UsageConfig(StrictModel):
    """Exact usage metering per key and run (`GET /api/v1/usage`, the console's usage page)."""

    enabled: bool = True
    """Record what every op used."""
    prices: dict[str, float] = Field(default_factory=dict)
    """Price per unit of each metered quantity (e.g. `trained_tokens: 0.000002`); reports add a cost column."""
    currency: str = "USD"
    """The unit prices are in."""

    @model_validator(mode="after")
    def _prices_name_metered_quantities(self) -> UsageConfig:
        for name, price in self.prices.items():
            if name not in METRICS:
                raise config_problem(f"{name!r} is not a metered quantity", subpath=f"prices.{name}",
                                     hint="price one of " + ", ".join(METRICS))
            if not price >= 0:  # NaN too
                raise config_problem(f"the price of {name} is {price}", subpath=f"prices.{name}",
                                     hint="a price is a number of at least 0 per unit")
        return self
