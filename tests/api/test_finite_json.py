"""Non-finite floats in answers: strings the Tinker SDK's types and twinkle_client read back as floats."""

from __future__ import annotations

import json
import math

import orjson
from tinker.types import OptimStepResponse

from api.finite_json import FiniteJSONResponse, finite_json
from twinkle_client.types import ForwardBackwardResult


def test_nan_and_infinities_become_strings_and_everything_else_is_untouched() -> None:
    value = {"loss": math.nan, "m": [math.inf, -math.inf, 1.5, 2], "nested": {"x": (math.nan,)}, "s": "NaN", "n": None}
    assert finite_json(value) == {"loss": "NaN", "m": ["Infinity", "-Infinity", 1.5, 2],
                                  "nested": {"x": ["NaN"]}, "s": "NaN", "n": None}


def test_the_response_is_standard_json_the_sdk_parser_accepts() -> None:
    body = FiniteJSONResponse({"metrics": {"loss:sum": math.nan, "grad_norm:mean": math.inf}}).body
    parsed = orjson.loads(body)  # the Tinker SDK's parser: it refuses a bare NaN token
    response = OptimStepResponse.model_validate(parsed)
    assert response.metrics is not None
    assert math.isnan(response.metrics["loss:sum"]) and response.metrics["grad_norm:mean"] == math.inf


def test_twinkle_client_reads_the_strings_back_as_floats() -> None:
    body = FiniteJSONResponse({"loss": math.nan, "logprobs": [[-math.inf, -1.0]]}).body
    result = ForwardBackwardResult.model_validate(json.loads(body))
    assert math.isnan(result.loss) and result.logprobs == [[-math.inf, -1.0]]


def test_finite_answers_take_the_fast_path_unchanged() -> None:
    assert FiniteJSONResponse({"a": 1.25, "b": [1, 2]}).body == b'{"a":1.25,"b":[1,2]}'
