"""What an API key's tier gives it: a fair-share weight, quotas on metered quantities, and a cap on its active
training runs.

Tiers are configured under `tenancy` (twinkle.config.tenancy); a key names its tier, and may override the tier's
weight, in the keys file (twinkle.keys_file). Keys listed in the config (`auth.api_keys`, `auth.admin_keys`), keys
that name no tier and every key in development mode get `tenancy.default_tier`. `twinkle.auth.KeyChecker`
resolves a request's policy together with its tenant id, re-reading the keys file when it changes, so an
operator's `twinkle-server keys set` applies without a restart. The API puts the weight on every future record
it submits (the pools share their compute by it) and checks the quotas when it accepts an op (api/quotas.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from twinkle.errors import QuotaExceeded
from twinkle.futures import Op
from twinkle.usage import SAVE_OPS, STEP_OPS, TRAIN_OPS, period_end

if TYPE_CHECKING:
    from twinkle.config.tenancy import TenancyConfig

PERIODS = ("day", "month", "total")
DEFAULT_TIER = "default"
TIER_NAME = re.compile(r"^(?!-$)[A-Za-z0-9._-]{1,64}$")  # what a keys file line can name ("-" means none)

# Ops that hold a pool's compute; bookkeeping (configure, metrics, train configs) and unloading stay allowed.
COMPUTE_OPS: frozenset[str] = frozenset(Op) - {Op.UNLOAD_MODEL, Op.CONFIGURE, Op.GET_TRAIN_CONFIGS,
                                               Op.CALCULATE_METRIC}

# The ops a quota on each metered quantity refuses once it is used up.
QUOTA_OPS: dict[str, frozenset[str]] = {
    "trained_tokens": frozenset(TRAIN_OPS),
    "forwarded_tokens": frozenset({Op.FORWARD}),
    "sampled_prompt_tokens": frozenset({Op.SAMPLE}),
    "sampled_tokens": frozenset({Op.SAMPLE}),
    "optim_steps": frozenset(STEP_OPS),
    "pool_ms": COMPUTE_OPS,
    "checkpoint_bytes": frozenset(SAVE_OPS),
}


@dataclass(frozen=True)
class Quota:
    """At most `limit` of `metric` per `period` ("day", "month" or "total")."""

    metric: str
    period: str
    limit: int


@dataclass(frozen=True)
class TenantPolicy:
    """What one request's key gets: resolved once per request, next to its tenant id."""

    tier: str = DEFAULT_TIER
    weight: float = 1.0
    quotas: tuple[Quota, ...] = ()
    max_training_runs: int = 0  # 0 = no limit beyond the server's per-key model limit

    def quotas_for(self, op: str) -> tuple[Quota, ...]:
        """The quotas that can refuse `op`."""
        return tuple(q for q in self.quotas if op in QUOTA_OPS.get(q.metric, ()))


DEFAULT_POLICY = TenantPolicy()


def combined_limit(*limits: int) -> int:
    """The smallest of the limits that are set (> 0); 0 when none is."""
    return min((limit for limit in limits if limit > 0), default=0)


class Policies:
    """The tiers of one config as policies, and the policy of a key from its keys-file entry."""

    def __init__(self, tenancy: TenancyConfig | None = None) -> None:
        self.tiers: dict[str, TenantPolicy] = {DEFAULT_TIER: DEFAULT_POLICY}
        self.default_tier = DEFAULT_TIER
        if tenancy is not None:
            self.default_tier = tenancy.default_tier
            self.tiers = {name: TenantPolicy(
                tier=name, weight=float(tier.weight), max_training_runs=tier.max_training_runs,
                quotas=tuple(Quota(metric, period, int(getattr(limits, period)))
                             for metric, limits in sorted(tier.quotas.items()) for period in PERIODS
                             if getattr(limits, period) > 0))
                for name, tier in tenancy.tiers.items()}
        self.default = self.tiers.get(self.default_tier, replace(DEFAULT_POLICY, tier=self.default_tier))
        self._own_weights: dict[tuple[str, float], TenantPolicy] = {}

    def for_key(self, tier: str = "", weight: float | None = None) -> TenantPolicy:
        """A key's policy: its tier's (the default tier's when it names none, or one the config lacks), with the
        key's own weight when it has one."""
        base = self.tiers.get(tier, self.default) if tier else self.default
        if weight is None or weight == base.weight:
            return base
        key = (base.tier, weight)
        if key not in self._own_weights:  # one object per (tier, weight), however many keys share it
            self._own_weights[key] = replace(base, weight=weight)
        return self._own_weights[key]

    def unknown(self, tiers: Iterable[str]) -> list[str]:
        """The tier names among `tiers` that the config does not define."""
        return sorted({tier for tier in tiers if tier and tier not in self.tiers})


_USED_IN = {"day": "today (UTC)", "month": "this month (UTC)", "total": "in all"}
_ALLOWED_PER = {"day": "per UTC day", "month": "per UTC month", "total": "in total"}


def iso_utc(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def quota_exceeded(op: str, policy: TenantPolicy, quota: Quota, used: int, at: float) -> QuotaExceeded:
    """The error for an op refused because `quota` is used up (`used` at time `at`)."""
    end = period_end(quota.period, at)
    resets_at = iso_utc(end) if end != float("inf") else None
    when = f"it resets at {resets_at}" if resets_at else "this quota never resets"
    hint = (f"Wait until {resets_at}, or ask the server operator for a higher quota or another tier." if resets_at
            else "Ask the server operator for a higher quota or another tier.")
    return QuotaExceeded(
        f"{op} refused: this API key has used {used} {quota.metric} {_USED_IN[quota.period]}, and its tier "
        f"{policy.tier!r} allows {quota.limit} {_ALLOWED_PER[quota.period]}; {when}.", hint=hint,
        quantity=quota.metric, period=quota.period, used=used, limit=quota.limit, resets_at=resets_at,
        tier=policy.tier)


def training_runs_exceeded(policy: TenantPolicy, active: int) -> QuotaExceeded:
    """The error for a model refused because the key has `active` training runs, its tier's most."""
    return QuotaExceeded(
        f"create_model refused: this API key has {active} active training runs, and its tier {policy.tier!r} "
        f"allows {policy.max_training_runs} at once; one frees up when a model is unloaded or expires.",
        hint="Unload a model you are done with (or finish its session), or ask the server operator for a tier "
        "with more training runs.", quantity="training_runs", used=active, limit=policy.max_training_runs,
        resets_at=None, tier=policy.tier)
