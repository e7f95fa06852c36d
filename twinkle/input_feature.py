"""InputFeature to Datum: the next-token training example the Tinker API (and Twinkle's backends) take.

Position t of the model input predicts token t + 1, so

    model_input    = input_ids[:-1]
    target_tokens  = labels[1:], with 0 where the label is -100
    weights        = 1.0 where labels[1:] != -100, else 0.0

Vision arrays (pixel_values, image_grid_thw, ...) ride along in `loss_fn_inputs` under their own names,
float32 or int64 as the Tinker wire format allows. The image placeholder tokens stay in the model input,
so positions line up with what the processor expanded.

`input_feature_to_datum` gives a `tinker.types.Datum` for the Tinker SDK (imported on call, so this
module works without it); `datum_from_input_feature` gives Twinkle's own `twinkle.types.Datum`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import InvalidRequest
from twinkle.types import Datum, chunks_from_tokens

if TYPE_CHECKING:
    import tinker

NOT_LOSS_INPUTS = frozenset({"input_ids", "labels", "attention_mask", "images", "extra", "position_ids"})


def shifted_arrays(input_feature: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The model input tokens and the loss inputs of one InputFeature (see the module docstring)."""
    for key in ("input_ids", "labels"):
        if key not in input_feature:
            raise InvalidRequest(
                f"An InputFeature needs {key!r}.", hint="Encode trajectories with a Template."
            )
    try:
        input_ids = np.asarray(input_feature["input_ids"], dtype=np.int64).reshape(-1)
        labels = np.asarray(input_feature["labels"], dtype=np.int64).reshape(-1)
    except (OverflowError, ValueError, TypeError) as exc:  # 10**20, "a", ragged lists: the caller's to fix
        raise InvalidRequest(f"input_ids and labels must be lists of token ids ({exc}).",
                             hint="Tokenize with the model's tokenizer; labels use -100 for untrained tokens.") from exc
    if input_ids.shape != labels.shape:
        raise InvalidRequest(f"input_ids has {input_ids.size} tokens but labels has {labels.size}.")
    if input_ids.size < 2:
        raise InvalidRequest(
            f"An InputFeature of {input_ids.size} token(s) has nothing to predict.",
            hint="Use at least 2 tokens.",
        )
    next_labels = labels[1:]
    trained = next_labels != IGNORE_INDEX
    loss_fn_inputs = {
        "target_tokens": np.where(trained, next_labels, 0).astype(np.int64),
        "weights": trained.astype(np.float32),
    }
    for key, value in input_feature.items():
        if key not in NOT_LOSS_INPUTS and isinstance(value, np.ndarray):
            loss_fn_inputs[key] = value.astype(
                np.float32 if value.dtype.kind == "f" else np.int64, copy=False
            )
    return input_ids[:-1], loss_fn_inputs


def datum_from_input_feature(input_feature: Mapping[str, Any]) -> Datum:
    """Twinkle's numpy Datum for an InputFeature, for server-side use without the Tinker SDK."""
    tokens, loss_fn_inputs = shifted_arrays(input_feature)
    return Datum(model_input=chunks_from_tokens(tokens), loss_fn_inputs=loss_fn_inputs)


def input_feature_to_datum(input_feature: Mapping[str, Any]) -> tinker.types.Datum:
    """The Tinker SDK Datum for an InputFeature, ready for `training_client.forward_backward`."""
    from tinker import types

    tokens, loss_fn_inputs = shifted_arrays(input_feature)
    return types.Datum(
        model_input=types.ModelInput.from_ints([int(token) for token in tokens]),
        loss_fn_inputs=loss_fn_inputs,  # type: ignore[arg-type]
    )
