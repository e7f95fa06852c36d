"""Finite but absurd optimizer settings are refused before they can overflow an adapter's weights."""

from __future__ import annotations

import math

import pytest

from twinkle.errors import InvalidRequest
from twinkle.hyperparameters import check_adam_params
from twinkle.trainer import TrainConfig
from twinkle.types import AdamParams


@pytest.mark.parametrize(("params", "fragment"), [
    (AdamParams(learning_rate=1e308), r"learning_rate is 1e\+308"),
    (AdamParams(learning_rate=1.5), "learning_rate is 1.5"),
    (AdamParams(weight_decay=1e10), "weight_decay"),
    (AdamParams(eps=1e300), "eps"),
    (AdamParams(learning_rate=math.nan), "not a finite number"),
])
def test_absurd_values_are_refused_naming_the_field(params: AdamParams, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        check_adam_params(params)


def test_useful_values_pass() -> None:
    params = AdamParams(learning_rate=1.0, weight_decay=0.1, eps=1e-8, grad_clip_norm=1e6)
    assert check_adam_params(params) is params


def test_a_twinkle_optimizer_with_an_absurd_learning_rate_is_refused_when_configured() -> None:
    config = TrainConfig()
    with pytest.raises(InvalidRequest, match="over the limit"):
        config.apply({"optimizer": "AdamW", "optimizer_kwargs": {"lr": 1e308}})
    with pytest.raises(InvalidRequest, match="learning rate"):
        config.apply({"optimizer_kwargs": {"lr": "fast"}})
    assert config.optimizer_kwargs.get("lr") != 1e308  # nothing changed
    config.apply({"optimizer_kwargs": {"lr": 1e-4}})
