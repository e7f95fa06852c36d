"""`usage.prices` names metered quantities only, with prices of at least 0."""

from __future__ import annotations

from typing import Any

import pytest

from twinkle.config import ConfigError, parse_config
from twinkle.usage import METRICS

APPS = [{"name": "m", "route_prefix": "/m", "import_path": "model", "args": {"model_id": "ms://a/b"}}]


def with_prices(prices: dict[str, Any]) -> Any:
    return parse_config({"applications": APPS, "usage": {"prices": prices}}, env={})


def test_every_metered_quantity_can_be_priced() -> None:
    config = with_prices({name: 0.5 for name in METRICS})
    assert config.usage.prices == {name: 0.5 for name in METRICS} and config.usage.currency == "USD"


def test_an_unknown_quantity_is_refused_with_the_list_of_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        with_prices({"trained_tokens": 0.1, "tokens": 0.2})
    (problem,) = caught.value.problems
    text = str(caught.value)
    assert "usage.prices.tokens" in text and "'tokens' is not a metered quantity" in text
    assert all(name in text for name in METRICS), problem


@pytest.mark.parametrize("price", [-0.01, float("nan")])
def test_a_negative_or_nan_price_is_refused(price: float) -> None:
    with pytest.raises(ConfigError, match=r"usage\.prices\.pool_ms: the price of pool_ms is"):
        with_prices({"pool_ms": price})
