from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from tinker import types

from twinkle.errors import InvalidRequest
from twinkle.server.common import datum_from_input_feature, input_feature_to_datum

FEATURE = {
    "input_ids": np.array([10, 11, 12, 13, 14], dtype=np.int64),
    "labels": np.array([-100, -100, 12, 13, -100], dtype=np.int64),
    "attention_mask": np.ones(5, dtype=np.int64),
    "extra": {"ground_truth": "3"},
}


def test_a_tinker_datum_predicts_each_next_token_weighted_where_labelled() -> None:
    datum = input_feature_to_datum(FEATURE)
    assert isinstance(datum, types.Datum)
    assert datum.model_input.to_ints() == [10, 11, 12, 13]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [0, 12, 13, 0]
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert datum.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert datum.loss_fn_inputs["weights"].dtype == "float32"


def test_the_twinkle_datum_carries_the_same_arrays_without_tinker() -> None:
    datum = datum_from_input_feature(FEATURE)
    assert datum.tokens().tolist() == [10, 11, 12, 13]
    np.testing.assert_array_equal(datum.loss_fn_inputs["target_tokens"], [0, 12, 13, 0])
    np.testing.assert_array_equal(datum.loss_fn_inputs["weights"], np.array([0, 1, 1, 0], dtype=np.float32))
    assert set(datum.loss_fn_inputs) == {"target_tokens", "weights"}


def test_vision_arrays_ride_along_as_loss_inputs() -> None:
    pixels = np.random.default_rng(0).random((1, 3, 4, 4)).astype(np.float64)
    datum = input_feature_to_datum({**FEATURE, "pixel_values": pixels})
    carried = datum.loss_fn_inputs["pixel_values"]
    assert carried.dtype == "float32" and carried.shape == [1, 3, 4, 4]
    np.testing.assert_allclose(carried.to_numpy(), pixels.astype(np.float32))


def test_features_too_short_or_inconsistent_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="nothing to predict"):
        datum_from_input_feature({"input_ids": np.array([1]), "labels": np.array([1])})
    with pytest.raises(InvalidRequest, match="labels has 2"):
        datum_from_input_feature({"input_ids": np.array([1, 2, 3]), "labels": np.array([1, 2])})
    with pytest.raises(InvalidRequest, match="labels"):
        datum_from_input_feature({"input_ids": np.array([1, 2, 3])})


def test_importing_the_converter_loads_neither_tinker_nor_torch_nor_datasets() -> None:
    code = "import sys, twinkle.server.common; print(' '.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    assert not loaded & {"tinker", "torch", "datasets", "transformers"}
