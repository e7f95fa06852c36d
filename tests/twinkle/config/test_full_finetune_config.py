"""`full_finetune` on a model application: off by default, refused where the backend has no full runs."""

from __future__ import annotations

from typing import Any

import pytest

from twinkle.catalog import Catalog
from twinkle.config import ConfigError, parse_config


def config(backend: str, full: dict[str, Any]) -> dict[str, Any]:
    return {"applications": [{"name": "m", "route_prefix": "/m", "import_path": "model",
                              "args": {"backend": backend, "model_id": "ms://a/b", "full_finetune": full}}]}


def test_full_runs_are_off_unless_the_operator_opens_a_pool_to_them() -> None:
    assert Catalog(parse_config(config("transformers", {}), env={})).reserving_queues == {}
    opened = Catalog(parse_config(config("mock", {"enabled": True, "while_reserved": "refuse"}), env={}))
    assert opened.reserving_queues == {"model.m.0": "refuse"}


def test_a_megatron_pool_open_to_full_runs_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config("megatron", {"enabled": True}), env={})
    (problem,) = caught.value.problems
    assert problem.path == "applications[0].args.full_finetune.enabled"
    assert "not available on the megatron backend" in problem.message


@pytest.mark.parametrize(("field", "value"), [("while_reserved", "queue"), ("lease_seconds", 0),
                                              ("max_shard_size", "two gigs")])
def test_a_full_finetune_value_out_of_range_is_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"full_finetune.{field}"):
        parse_config(config("transformers", {"enabled": True, field: value}), env={})
