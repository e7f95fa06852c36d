"""The Tinker loss functions: their inputs, their configuration, and a numpy reference implementation.

Every loss is a sum over tokens of a term that depends only on that token's target logprob `lp` (the
model's log-probability of `target_tokens[t]`) and that token's inputs. So a backend computes `lp`, asks
`elementwise_loss_and_grad` for the per-token loss and `dloss/dlp`, and back-propagates `dloss/dlp`
through its log-softmax. Framework backends (torch) mirror the formulas below; the numpy versions are the
reference they are compared against.

With `ratio = exp(lp - old_lp)`, where `old_lp` is the `logprobs` input (the sampler's logprobs), and `A` the
`advantages` input:

    cross_entropy        L = -Σ w·lp                                    (w = `weights`, default 1)
    importance_sampling  L = -Σ ratio·A
    ppo                  L = -Σ min(ratio·A, clip(ratio, lo, hi)·A)
    cispo                L = -Σ stopgrad(clip(ratio, lo, hi))·A·lp
    dro                  L = -Σ (A·lp - beta/2·(lp - old_lp)²)

`lo`/`hi` are `clip_low_threshold`/`clip_high_threshold` (defaults 0.8 and 1.2), `beta` defaults to 0.05.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from twinkle.errors import InvalidRequest
from twinkle.types import Datum, input_length

_MAX_LISTED_PROBLEMS = 10


@dataclass(frozen=True)
class LossSpec:
    """What one loss function needs from the caller."""

    name: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...]  # filled with ones when absent
    config_defaults: Mapping[str, float]
    formula: str


_CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSS_FUNCTIONS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("target_tokens",), ("weights",), {}, "-Σ w·lp"),
        LossSpec("importance_sampling", _RL_INPUTS, (), {}, "-Σ exp(lp - old_lp)·A"),
        LossSpec("ppo", _RL_INPUTS, (), _CLIP_DEFAULTS, "-Σ min(ratio·A, clip(ratio, lo, hi)·A)"),
        LossSpec("cispo", _RL_INPUTS, (), _CLIP_DEFAULTS, "-Σ stopgrad(clip(ratio, lo, hi))·A·lp"),
        LossSpec("dro", _RL_INPUTS, (), {"beta": 0.05}, "-Σ (A·lp - beta/2·(lp - old_lp)²)"),
    )
}


@dataclass(frozen=True)
class ElementwiseLoss:
    """Per-token loss and its derivative with respect to the per-token target logprobs."""

    loss: np.ndarray  # same shape as lp
    dloss_dlp: np.ndarray  # same shape as lp
    metrics: dict[str, float]  # extra metrics keyed `name:reduction`, all reductions `sum`


def loss_spec(loss_fn: str) -> LossSpec:
    """The spec of `loss_fn`; raises InvalidRequest naming the supported losses when it is unknown."""
    spec = LOSS_FUNCTIONS.get(loss_fn)
    if spec is None:
        raise InvalidRequest(
            f"Unknown loss_fn {loss_fn!r}.",
            hint=f"Supported loss functions: {', '.join(LOSS_FUNCTIONS)}.",
        )
    return spec


def resolve_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """The loss config with defaults filled in; raises InvalidRequest for unknown keys or bad values."""
    spec = loss_spec(loss_fn)
    problems = _config_problems(spec, config or {})
    if problems:
        raise _invalid(loss_fn, problems)
    resolved = dict(spec.config_defaults)
    resolved.update({key: float(value) for key, value in (config or {}).items()})
    return resolved


def loss_inputs(loss_fn: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays the loss reads, with optional inputs defaulted (weights → ones)."""
    spec = loss_spec(loss_fn)
    resolved = {key: np.asarray(inputs[key]) for key in spec.required_inputs}
    target_shape = resolved["target_tokens"].shape
    for key in spec.optional_inputs:
        value = inputs.get(key)
        resolved[key] = np.ones(target_shape, np.float32) if value is None else np.asarray(value)
    return resolved


def validate_loss(loss_fn: str, data: list[Datum], config: Mapping[str, float | str] | None) -> None:
    """Check a batch against `loss_fn` before any compute; raise one InvalidRequest listing every problem.

    Checks: the loss exists, each datum has the required `loss_fn_inputs`, `target_tokens` is an integer
    array whose first dimension equals the model input's token count, every other input has the shape of
    `target_tokens`, float inputs are finite, and the config has only known keys with valid numbers.
    """
    spec = loss_spec(loss_fn)
    problems = _config_problems(spec, config or {})
    if not data:
        problems.append("the batch has no datums")
    for index, datum in enumerate(data):
        problems.extend(f"datum {index}: {problem}" for problem in _datum_problems(spec, datum))
    if problems:
        raise _invalid(loss_fn, problems)


def elementwise_loss_and_grad(
    loss_fn: str, lp: np.ndarray, inputs: Mapping[str, np.ndarray], config: Mapping[str, float | str] | None
) -> ElementwiseLoss:
    """Per-token loss and dloss/dlp of `loss_fn` at target logprobs `lp` (the formulas in the module doc).

    `inputs` are the datum's `loss_fn_inputs` (several datums may be concatenated: every loss is a sum of
    per-token terms). Computation happens in the dtype of `lp`.
    """
    resolved_config = resolve_config(loss_fn, config)
    arrays = {
        key: value.astype(lp.dtype, copy=False)
        for key, value in loss_inputs(loss_fn, inputs).items()
        if key != "target_tokens"
    }
    return _IMPLEMENTATIONS[loss_fn](lp, arrays, resolved_config)


def loss_and_grad(
    loss_fn: str, lp: np.ndarray, inputs: Mapping[str, np.ndarray], config: Mapping[str, float | str] | None
) -> tuple[float, np.ndarray, dict[str, float]]:
    """`(Σ loss, dloss/dlp, extra metrics)` of `loss_fn` at target logprobs `lp`."""
    result = elementwise_loss_and_grad(loss_fn, lp, inputs, config)
    return float(result.loss.sum(dtype=np.float64)), result.dloss_dlp, result.metrics


def _cross_entropy(lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> ElementwiseLoss:
    weights = x["weights"]
    return ElementwiseLoss(-weights * lp, -weights, {})


def _importance_sampling(
    lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]
) -> ElementwiseLoss:
    weighted_ratio = np.exp(lp - x["logprobs"]) * x["advantages"]
    return ElementwiseLoss(-weighted_ratio, -weighted_ratio, {})


def _ppo(lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> ElementwiseLoss:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    advantages = x["advantages"]
    ratio = np.exp(lp - x["logprobs"])
    unclipped = ratio * advantages
    clipped = np.clip(ratio, low, high) * advantages
    # The clipped branch can only be strictly smaller outside [lo, hi], where it is flat (zero gradient).
    # On ties both branches have the same value and slope, so taking the unclipped one is exact.
    flat = clipped < unclipped
    grad = np.where(flat, 0.0, -unclipped).astype(lp.dtype, copy=False)
    loss = -np.minimum(unclipped, clipped)
    return ElementwiseLoss(loss, grad, {"clipped_tokens:sum": float(np.count_nonzero(flat))})


def _cispo(lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> ElementwiseLoss:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio = np.exp(lp - x["logprobs"])
    coefficient = np.clip(ratio, low, high) * x["advantages"]  # held constant: stopgrad
    clipped_tokens = np.count_nonzero((ratio < low) | (ratio > high))
    return ElementwiseLoss(-coefficient * lp, -coefficient, {"clipped_tokens:sum": float(clipped_tokens)})


def _dro(lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> ElementwiseLoss:
    beta = lp.dtype.type(config["beta"])
    advantages = x["advantages"]
    drift = lp - x["logprobs"]
    loss = -(advantages * lp - beta / 2 * drift * drift)
    return ElementwiseLoss(loss, beta * drift - advantages, {})


_Implementation = Callable[[np.ndarray, dict[str, np.ndarray], dict[str, float]], ElementwiseLoss]
_IMPLEMENTATIONS: dict[str, _Implementation] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
}


def _config_problems(spec: LossSpec, config: Mapping[str, float | str]) -> list[str]:
    problems = []
    for key, value in config.items():
        if key not in spec.config_defaults:
            accepted = ", ".join(spec.config_defaults) or "none"
            problems.append(f"unknown loss_fn_config key {key!r} (accepted keys: {accepted})")
        elif isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
            problems.append(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    if problems:
        return problems
    merged = {**spec.config_defaults, **{key: float(value) for key, value in config.items()}}
    if "clip_low_threshold" in merged:
        low, high = merged["clip_low_threshold"], merged["clip_high_threshold"]
        if not 0 <= low <= high:
            problems.append(
                f"clip thresholds must satisfy 0 <= clip_low_threshold <= clip_high_threshold, "
                f"got {low} and {high}"
            )
    if merged.get("beta", 0.0) < 0:
        problems.append(f"beta must be >= 0, got {merged['beta']}")
    return problems


def _datum_problems(spec: LossSpec, datum: Datum) -> list[str]:
    inputs = datum.loss_fn_inputs
    missing = [key for key in spec.required_inputs if key not in inputs]
    if missing:
        return [f"loss_fn_inputs lacks {', '.join(map(repr, missing))} (required by {spec.name})"]
    problems = []
    targets = np.asarray(inputs["target_tokens"])
    token_count = input_length(datum.model_input)
    if targets.dtype.kind not in "iu":
        problems.append(f"target_tokens must hold integers, got dtype {targets.dtype}")
    if targets.ndim not in (1, 2):
        problems.append(f"target_tokens must have shape [T] or [T, K], got {list(targets.shape)}")
    elif targets.shape[0] != token_count:
        problems.append(
            f"target_tokens has {targets.shape[0]} positions but model_input has {token_count} tokens; "
            "they must be equal (target_tokens[t] is the token that follows model_input[t])"
        )
    for key in spec.required_inputs[1:] + spec.optional_inputs:
        if key not in inputs:
            continue
        values = np.asarray(inputs[key])
        if values.shape != targets.shape:
            problems.append(
                f"{key} has shape {list(values.shape)} but target_tokens has {list(targets.shape)}; "
                "they must be equal"
            )
        elif values.dtype.kind not in "iuf":
            problems.append(f"{key} must hold numbers, got dtype {values.dtype}")
        elif not np.isfinite(values).all():
            problems.append(
                f"{key} has {np.count_nonzero(~np.isfinite(values))} non-finite values (NaN or inf)"
            )
    return problems


def _invalid(loss_fn: str, problems: list[str]) -> InvalidRequest:
    listed = problems[:_MAX_LISTED_PROBLEMS]
    more = len(problems) - len(listed)
    message = (
        f"Invalid {loss_fn} request: " + "; ".join(listed) + (f"; and {more} more" if more else "") + "."
    )
    return InvalidRequest(message, problems=len(problems))
