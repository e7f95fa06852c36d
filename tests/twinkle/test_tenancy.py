"""Policies per key: the tier's weight, quotas and training-run cap, a key's own weight over its tier's, and the
ops each quota refuses."""

from __future__ import annotations

from datetime import UTC, datetime

from twinkle.config.tenancy import QuotaConfig, TenancyConfig, TierConfig
from twinkle.futures import Op
from twinkle.tenancy import (
    COMPUTE_OPS,
    DEFAULT_POLICY,
    QUOTA_OPS,
    Policies,
    Quota,
    TenantPolicy,
    combined_limit,
    quota_exceeded,
    training_runs_exceeded,
)
from twinkle.usage import METRICS, day_of, month_of

TENANCY = TenancyConfig(default_tier="free", tiers={
    "free": TierConfig(weight=0.5, max_training_runs=1,
                       quotas={"trained_tokens": QuotaConfig(day=1000, total=5000), "pool_ms": QuotaConfig()}),
    "gold": TierConfig(weight=4),
})


def test_a_key_gets_its_tiers_weight_quotas_and_training_run_cap() -> None:
    policies = Policies(TENANCY)
    free = policies.for_key("free")
    assert free == TenantPolicy(tier="free", weight=0.5, max_training_runs=1, quotas=(
        Quota("trained_tokens", "day", 1000), Quota("trained_tokens", "total", 5000)))  # zero limits are none
    assert policies.for_key("gold") == TenantPolicy(tier="gold", weight=4.0)


def test_a_keys_own_weight_overrides_its_tiers_and_keeps_the_rest() -> None:
    policies = Policies(TENANCY)
    own = policies.for_key("free", 3.0)
    assert own.weight == 3.0 and own.tier == "free" and own.quotas == policies.for_key("free").quotas
    assert policies.for_key("free", 3.0) is own  # one object per (tier, weight)
    assert policies.for_key("gold", 4.0) is policies.for_key("gold")


def test_keys_naming_no_tier_or_an_unknown_one_get_the_default_tier() -> None:
    policies = Policies(TENANCY)
    assert policies.for_key() is policies.for_key("platinum") is policies.default
    assert policies.default.tier == "free"
    assert policies.unknown(["free", "", "platinum", "gold"]) == ["platinum"]


def test_without_tenancy_config_every_key_gets_weight_1_and_no_quotas() -> None:
    assert Policies().for_key("anything") == DEFAULT_POLICY == TenantPolicy("default", 1.0, (), 0)


def test_each_quota_refuses_the_ops_that_use_its_quantity() -> None:
    assert set(QUOTA_OPS) == set(METRICS)
    refused = {metric: TenantPolicy(quotas=(Quota(metric, "day", 1),)) for metric in METRICS}
    assert refused["trained_tokens"].quotas_for(Op.FORWARD_BACKWARD)
    assert not refused["trained_tokens"].quotas_for(Op.FORWARD)
    assert refused["forwarded_tokens"].quotas_for(Op.FORWARD)
    assert refused["sampled_tokens"].quotas_for(Op.SAMPLE) and refused["sampled_prompt_tokens"].quotas_for("sample")
    assert refused["optim_steps"].quotas_for(Op.OPTIM_STEP) and refused["optim_steps"].quotas_for(
        Op.CLIP_GRAD_AND_STEP)
    for save in (Op.SAVE_STATE, Op.SAVE_WEIGHTS_FOR_SAMPLER, Op.SAVE_WEIGHTS_EXTERNAL):
        assert refused["checkpoint_bytes"].quotas_for(save)
    assert not refused["checkpoint_bytes"].quotas_for(Op.OPTIM_STEP)
    assert all(refused["pool_ms"].quotas_for(op) for op in COMPUTE_OPS)
    assert {Op.FORWARD_BACKWARD, Op.SAMPLE, Op.ENCODE, Op.CREATE_MODEL} <= COMPUTE_OPS
    assert not refused["pool_ms"].quotas_for(Op.UNLOAD_MODEL)  # unloading frees what the key holds


def test_the_smaller_set_limit_wins() -> None:
    assert combined_limit(3, 1) == 1 and combined_limit(0, 2) == 2 and combined_limit(4, 0) == 4
    assert combined_limit(0, 0) == 0


def test_a_quota_refusal_names_the_quantity_used_limit_and_reset_and_says_what_to_do() -> None:
    at = datetime(2025, 3, 31, 22, 0, tzinfo=UTC).timestamp()
    policy = Policies(TENANCY).for_key("free")
    daily = quota_exceeded("forward_backward", policy, Quota("trained_tokens", "day", 1000), 1200, at)
    assert daily.status_code == 403 and daily.code == "quota_exceeded" and daily.category == "user"
    assert "1200 trained_tokens" in daily.message and "allows 1000 per UTC day" in daily.message
    assert "resets at 2025-04-01T00:00:00Z" in daily.message and "'free'" in daily.message
    assert "Wait until 2025-04-01T00:00:00Z" in str(daily) and "operator" in str(daily)
    assert daily.details == {"quantity": "trained_tokens", "period": "day", "used": 1200, "limit": 1000,
                             "resets_at": "2025-04-01T00:00:00Z", "tier": "free"}
    monthly = quota_exceeded("sample", policy, Quota("sampled_tokens", "month", 10), 10, at)
    assert "resets at 2025-04-01T00:00:00Z" in monthly.message
    total = quota_exceeded("forward_backward", policy, Quota("trained_tokens", "total", 5000), 5000, at)
    assert "never resets" in total.message and total.details["resets_at"] is None
    assert "Wait" not in str(total)
    runs = training_runs_exceeded(policy, 1)
    assert "1 active training runs" in runs.message and "allows 1 at once" in runs.message
    assert runs.details["quantity"] == "training_runs"



def test_usage_periods_are_named_by_the_utc_day_and_month_and_turn_over_at_utc_midnight() -> None:
    midnight = datetime(2026, 3, 1, tzinfo=UTC).timestamp()
    assert (day_of(midnight - 0.001), month_of(midnight - 0.001)) == ("2026-02-28", "2026-02")
    assert (day_of(midnight), month_of(midnight)) == ("2026-03-01", "2026-03")
    assert day_of(0) == "1970-01-01" and day_of(midnight + 86399.9) == "2026-03-01"
