"""API keys: hashes only, the keys file re-read when it changes, at most one stat per second, and each key's
policy (tier, weight) resolved from the same read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from twinkle.auth import KeyChecker, hash_key, read_keys_file, tenant_id
from twinkle.config.tenancy import QuotaConfig, TenancyConfig, TierConfig
from twinkle.errors import Unauthenticated
from twinkle.keys_file import add_key, read_entries, revoke, set_tier
from twinkle.tenancy import TenantPolicy


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_revoked_key_is_refused_after_the_recheck_interval_without_a_restart(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    raw, _ = add_key(keys_file, "alice")
    clock = FakeClock()
    checker = KeyChecker(set(), str(keys_file), clock=clock)
    assert checker.tenant_for(raw) == tenant_id(raw)
    revoke(keys_file, "alice")
    clock.now += 0.5
    assert checker.tenant_for(raw) == tenant_id(raw)  # cached: the file is not stat'ed yet
    clock.now += 0.6
    with pytest.raises(Unauthenticated):
        checker.tenant_for(raw)


def test_the_keys_file_is_stated_at_most_once_per_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file = tmp_path / "keys"
    raw, _ = add_key(keys_file)
    clock = FakeClock()
    checker = KeyChecker(set(), str(keys_file), clock=clock)
    checker.tenant_for(raw)  # loads the file
    stats: list[object] = []
    real_stat = os.stat

    def counting_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        stats.append(path)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", counting_stat)
    for _ in range(100):
        checker.tenant_for(raw)
    assert stats == []
    clock.now += 1
    checker.tenant_for(raw)
    assert len(stats) == 1  # unchanged since: stat'ed, not read again


def test_a_key_added_later_is_accepted_and_a_missing_file_accepts_nobody(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    clock = FakeClock()
    checker = KeyChecker(set(), str(keys_file), clock=clock)
    assert not checker.dev_mode
    with pytest.raises(Unauthenticated, match="not valid"):
        checker.tenant_for("tw-anything")
    raw, _ = add_key(keys_file)
    clock.now += 1
    assert checker.tenant_for(raw).startswith("t")


def test_configured_hashes_work_alongside_the_file_and_no_key_is_refused(tmp_path: Path) -> None:
    checker = KeyChecker({hash_key("tml-static")}, str(tmp_path / "absent"))
    assert checker.tenant_for("tml-static") == tenant_id("tml-static")
    with pytest.raises(Unauthenticated, match="no API key"):
        checker.tenant_for(None)


def test_the_file_stores_hashes_labels_and_times_never_the_key(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    raw, entry = add_key(keys_file, "ci-runner")
    unlabelled_raw, _ = add_key(keys_file)
    text = keys_file.read_text()
    assert raw not in text and unlabelled_raw not in text
    assert raw.startswith("tw-") and len(raw) == 35
    assert read_keys_file(keys_file) == {hash_key(raw), hash_key(unlabelled_raw)}
    labels = [(e.label, bool(e.created)) for e in read_entries(keys_file)]
    assert labels == [("ci-runner", True), ("", True)]
    assert entry.key_hash == hash_key(raw)
    assert keys_file.stat().st_mode & 0o077 == 0


def test_a_bare_hash_file_written_by_hand_still_reads(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# ops team\n{hash_key('tml-a')}\n\n{hash_key('tml-b').upper()}  # bob\n")
    assert read_keys_file(keys_file) == {hash_key("tml-a"), hash_key("tml-b")}
    assert [e.label for e in read_entries(keys_file)] == ["", ""]


def test_an_admin_key_is_accepted_and_marked_while_tenant_keys_are_not() -> None:
    checker = KeyChecker({hash_key("tenant-key")}, admin_hashes={hash_key("operator-key")})
    assert checker.tenant_for("operator-key") == tenant_id("operator-key")
    assert checker.is_admin("operator-key")
    assert not checker.is_admin("tenant-key") and not checker.is_admin(None)
    assert not checker.dev_mode


def test_development_mode_makes_nobody_an_admin() -> None:
    checker = KeyChecker(set())
    assert checker.dev_mode and not checker.is_admin("anything")


TENANCY = TenancyConfig(default_tier="free", tiers={
    "free": TierConfig(weight=1, quotas={"trained_tokens": QuotaConfig(day=100)}), "gold": TierConfig(weight=4)})


def test_a_keys_policy_comes_from_its_tier_in_the_file_and_its_own_weight_overrides_the_tiers(
        tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    gold, _ = add_key(keys_file, "gold", tier="gold")
    heavy, _ = add_key(keys_file, "heavy", tier="gold", weight=8)
    plain, _ = add_key(keys_file, "plain")
    checker = KeyChecker(set(), str(keys_file), tenancy=TENANCY)
    assert checker.identify(gold) == (tenant_id(gold), TenantPolicy(tier="gold", weight=4.0))
    assert checker.identify(heavy)[1] == TenantPolicy(tier="gold", weight=8.0)
    assert checker.identify(plain)[1] == checker.policies.default
    assert checker.identify(plain)[1].tier == "free" and checker.identify(plain)[1].quotas


def test_a_weight_or_tier_changed_in_the_file_applies_at_the_next_recheck_without_a_restart(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    raw, _ = add_key(keys_file, "alice")
    clock = FakeClock()
    checker = KeyChecker(set(), str(keys_file), clock=clock, tenancy=TENANCY)
    assert checker.identify(raw)[1].weight == 1.0
    set_tier(keys_file, "alice", tier="gold", weight=2.5)
    clock.now += 0.5
    assert checker.identify(raw)[1].weight == 1.0  # not stat'ed again yet
    clock.now += 0.6
    assert checker.identify(raw)[1] == TenantPolicy(tier="gold", weight=2.5)
    set_tier(keys_file, "alice", tier="-", weight=0)
    clock.now += 1.1
    assert checker.identify(raw)[1] is checker.policies.default


def test_config_listed_keys_and_keys_in_development_mode_get_the_default_tier(tmp_path: Path) -> None:
    configured = KeyChecker({hash_key("tml-listed")}, admin_hashes={hash_key("tml-admin")}, tenancy=TENANCY)
    assert configured.identify("tml-listed")[1].tier == "free"
    assert configured.identify("tml-admin")[1].tier == "free"
    dev = KeyChecker(set(), tenancy=TENANCY)
    assert dev.dev_mode and dev.identify("tml-anything") == (tenant_id("tml-anything"), dev.policies.default)


def test_a_key_naming_a_tier_the_config_lacks_gets_the_default_tier_and_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys_file = tmp_path / "keys"
    raw, _ = add_key(keys_file, "alice", tier="platinum", weight=3)
    checker = KeyChecker(set(), str(keys_file), tenancy=TENANCY)
    with caplog.at_level("WARNING", logger="twinkle.auth"):
        policy = checker.identify(raw)[1]
    assert policy.tier == "free" and policy.weight == 3.0
    assert "platinum" in caplog.text
