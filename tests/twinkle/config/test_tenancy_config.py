"""`tenancy`: the default tier is one of the tiers, quotas name metered quantities, tier names fit a keys file;
`check-config` refuses a config that breaks any of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from twinkle.config import ConfigError, Problem, parse_config
from twinkle.keys_file import add_key
from twinkle.server.cli import EXIT_OK, EXIT_USAGE, main
from twinkle.usage import METRICS

APPS = [{"name": "m", "route_prefix": "/m", "import_path": "model", "args": {"model_id": "ms://a/b"}}]


def with_tenancy(tenancy: dict[str, Any]) -> Any:
    return parse_config({"applications": APPS, "tenancy": tenancy}, env={})


def problems(tenancy: dict[str, Any]) -> list[Problem]:
    with pytest.raises(ConfigError) as caught:
        with_tenancy(tenancy)
    return caught.value.problems


def test_tiers_take_a_weight_quotas_on_every_metered_quantity_and_a_training_run_cap() -> None:
    config = with_tenancy({"default_tier": "free", "tiers": {
        "free": {"weight": 0.5, "max_training_runs": 2, "quotas": {name: {"day": 10} for name in METRICS}},
        "gold": {"weight": 4, "quotas": {"pool_ms": {"month": 3_600_000, "total": 10**9}}}}})
    assert config.tenancy.tiers["free"].quotas["trained_tokens"].day == 10
    assert config.tenancy.tiers["gold"].quotas["pool_ms"].total == 10**9


def test_without_a_tenancy_section_there_is_one_default_tier_with_weight_1_and_no_quotas() -> None:
    tenancy = with_tenancy({}).tenancy
    assert tenancy.default_tier == "default" and list(tenancy.tiers) == ["default"]
    assert tenancy.tiers["default"].weight == 1.0 and tenancy.tiers["default"].quotas == {}


def test_a_default_tier_that_is_not_a_tier_is_refused_naming_the_tiers() -> None:
    (problem,) = problems({"default_tier": "free", "tiers": {"gold": {}, "silver": {}}})
    assert problem.path == "tenancy.default_tier"
    assert "'free' is not one of the tiers" in problem.message and "gold, silver" in (problem.hint or "")


def test_a_quota_on_a_quantity_that_is_not_metered_is_refused_listing_the_metered_ones() -> None:
    (problem,) = problems({"tiers": {"default": {"quotas": {"tokens": {"day": 5}}}}})
    assert problem.path == "tenancy.tiers.default.quotas.tokens"
    assert "'tokens' is not a metered quantity" in problem.message
    assert all(name in (problem.hint or "") for name in METRICS)


@pytest.mark.parametrize("quota", [{"day": -1}, {"week": 5}])
def test_a_negative_or_unknown_quota_period_is_refused(quota: dict[str, int]) -> None:
    assert problems({"tiers": {"default": {"quotas": {"pool_ms": quota}}}})


@pytest.mark.parametrize("weight", [0, -1, 1001])
def test_a_tier_weight_must_be_above_0_and_at_most_1000(weight: float) -> None:
    (problem,) = problems({"tiers": {"default": {"weight": weight}}})
    assert problem.path == "tenancy.tiers.default.weight"


def test_a_tier_name_a_keys_file_cannot_hold_is_refused() -> None:
    (problem,) = problems({"tiers": {"default": {}, "gold tier": {}}})
    assert problem.path == "tenancy.tiers.gold tier" and "keys file" in problem.message


def _config_file(tmp_path: Path, tenancy: dict[str, Any], keys_file: Path | None = None) -> Path:
    path = tmp_path / "server.yaml"
    auth = {"keys_file": str(keys_file)} if keys_file else {}
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}}],
        "tenancy": tenancy, "auth": auth}))
    return path


def test_check_config_refuses_an_unknown_default_tier_and_an_unmetered_quota(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config_file(tmp_path, {"default_tier": "free", "tiers": {"default": {}}})
    assert main(["check-config", "-c", str(config)]) == EXIT_USAGE
    assert "tenancy.default_tier: 'free' is not one of the tiers" in capsys.readouterr().err
    config = _config_file(tmp_path, {"tiers": {"default": {"quotas": {"gpu_hours": {"day": 1}}}}})
    assert main(["check-config", "-c", str(config)]) == EXIT_USAGE
    assert "tenancy.tiers.default.quotas.gpu_hours: 'gpu_hours' is not a metered quantity" in capsys.readouterr().err


def test_check_config_warns_about_keys_naming_a_tier_the_config_lacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys"
    add_key(keys_file, "alice", tier="platinum")
    config = _config_file(tmp_path, {"tiers": {"default": {}, "gold": {}}}, keys_file)
    assert main(["check-config", "-c", str(config)]) == EXIT_OK
    assert "platinum" in capsys.readouterr().err
