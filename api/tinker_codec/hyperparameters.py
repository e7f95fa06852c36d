"""Tinker `SamplingParams` and `AdamParams` JSON objects as Twinkle's, validated."""

from __future__ import annotations

from typing import Any

from api.tinker_codec.json_fields import as_object, finite_number, is_integer, json_kind, optional_integer
from twinkle.errors import InvalidRequest
from twinkle.hyperparameters import check_adam_params
from twinkle.types import AdamParams, SamplingParams


def sampling_params_from_json(obj: Any, *, vocab_size: int | None = None) -> SamplingParams:
    """Missing or null fields take Twinkle's defaults; `stop` None means EOS only, [] no stop at all."""
    where = "sampling_params"
    params = as_object(obj, where)
    defaults = SamplingParams()
    max_tokens = optional_integer(params, "max_tokens", where)
    if max_tokens is not None and max_tokens < 0:
        raise InvalidRequest(f"{where}.max_tokens must not be negative, got {max_tokens}.")
    temperature = finite_number(params, "temperature", defaults.temperature, where)
    if temperature < 0:
        raise InvalidRequest(f"{where}.temperature must be >= 0, got {temperature}.")
    top_p = finite_number(params, "top_p", defaults.top_p, where)
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"{where}.top_p must lie in (0, 1], got {top_p}.")
    top_k = optional_integer(params, "top_k", where)
    if top_k is not None and top_k != -1 and top_k < 1:
        raise InvalidRequest(f"{where}.top_k must be -1 (no limit) or positive, got {top_k}.")
    stop_token_ids, stop_strings, stop_at_eos = _stop(params.get("stop"), where, vocab_size)
    return SamplingParams(
        max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
        temperature=temperature,
        top_k=defaults.top_k if top_k is None else top_k,
        top_p=top_p,
        seed=optional_integer(params, "seed", where),
        stop_token_ids=stop_token_ids,
        stop_strings=stop_strings,
        stop_at_eos=stop_at_eos,
    )


def adam_params_from_json(obj: Any) -> AdamParams:
    """Missing or null fields take the Tinker defaults."""
    where = "adam_params"
    params = as_object(obj, where)
    defaults = AdamParams()
    values = {
        name: finite_number(params, name, getattr(defaults, name), where)
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    }
    if values["learning_rate"] < 0:
        raise InvalidRequest(f"{where}.learning_rate must be >= 0, got {values['learning_rate']}.")
    for beta in ("beta1", "beta2"):
        if not 0 <= values[beta] < 1:
            raise InvalidRequest(f"{where}.{beta} must lie in [0, 1), got {values[beta]}.")
    if values["eps"] <= 0:
        raise InvalidRequest(f"{where}.eps must be > 0, got {values['eps']}.")
    if values["weight_decay"] < 0:
        raise InvalidRequest(f"{where}.weight_decay must be >= 0, got {values['weight_decay']}.")
    # Tinker documents a non-positive clip norm as "no clipping"; Twinkle spells that 0.
    values["grad_clip_norm"] = max(values["grad_clip_norm"], 0.0)
    return check_adam_params(AdamParams(**values), where)


def _stop(value: Any, where: str, vocab_size: int | None) -> tuple[tuple[int, ...], tuple[str, ...], bool]:
    """(stop token ids, stop strings, stop at EOS) for Tinker's `stop` field."""
    if value is None:
        return (), (), True
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequest(f"{where}.stop must be a string or a list, got {json_kind(value)}.")
    if not value:
        return (), (), False
    if all(isinstance(item, str) for item in value):
        if not all(value):
            raise InvalidRequest(f"{where}.stop holds an empty string, which would stop at once.")
        return (), tuple(value), True
    if all(is_integer(item) for item in value):
        for token in value:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise InvalidRequest(f"{where}.stop holds token id {token}, outside the vocabulary.")
        return tuple(int(t) for t in value), (), True
    raise InvalidRequest(f"{where}.stop must be all strings or all token ids, not a mix.")
