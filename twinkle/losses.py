"""The Tinker loss functions: their inputs, their configuration, and a numpy reference implementation.

Every loss is a sum over tokens of a term that depends only on that token's target logprob `lp` (the
model's log-probability of `target_tokens[t]`) and that token's inputs (gspo's term also reads its datum's
sequence ratio, which the gradient holds constant). So a backend computes `lp`, asks
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
    gspo                 L = -Σ min(s_t·A, clip(s_t, lo, hi)·A)
    stable_reinforce     L = -Σ [lo ≤ ratio ≤ hi]·stopgrad(ratio)·A·lp + kl_coeff·Σ_sampled (ratio - 1 - log ratio)

`lo`/`hi` are `clip_low_threshold`/`clip_high_threshold` (defaults 0.8 and 1.2; 0.5 and 2.0 for
stable_reinforce), `beta` defaults to 0.05, `kl_coeff` to 0.

gspo (GSPO-token, as the Tinker docs define it): per datum, the sequence log-ratio is the mean of
`lp - old_lp` over the positions `sequence_ratio_mask` marks (default: the positions with a nonzero
advantage, the ones the loss trains; none marked → ratio 1). Every token's ratio s_t has that value,
held constant, times exp(lp - stopgrad(lp)): the value of the sequence ratio, the gradient of its own lp.
So dL/dlp_t = -s·A_t, or 0 where the clipped branch is strictly smaller (s outside [lo, hi]).

stable_reinforce: REINFORCE on the sampled tokens, importance-weighted by the (held constant) ratio of the
learner to the sampler, where tokens whose ratio left the trust region [lo, hi] are dropped instead of
clipped, so stale (off-policy) or numerically mismatched samples cannot blow up an update; `kl_coeff`
adds the k3 estimate of KL(sampler ‖ learner) on the sampled positions (those carrying a sampling
logprob or a nonzero advantage; prompt positions carry 0 for both). As in Tinker, a batch must come from
samples made with `record_stability_info=True` and name them with provenance spans (the API checks that:
api.provenance); the loss reads the datum's own `logprobs`, the sampler's logprobs of the sampled tokens,
which the cookbook sends. Tinker does not publish its formula; this one is documented here and in README.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
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
_TRUST_REGION = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0, "kl_coeff": 0.0}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_SEQUENCE_RATIO_MASK = "sequence_ratio_mask"

LOSS_FUNCTIONS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("target_tokens",), ("weights",), {}, "-Σ w·lp"),
        LossSpec("importance_sampling", _RL_INPUTS, (), {}, "-Σ exp(lp - old_lp)·A"),
        LossSpec("ppo", _RL_INPUTS, (), _CLIP_DEFAULTS, "-Σ min(ratio·A, clip(ratio, lo, hi)·A)"),
        LossSpec("cispo", _RL_INPUTS, (), _CLIP_DEFAULTS, "-Σ stopgrad(clip(ratio, lo, hi))·A·lp"),
        LossSpec("dro", _RL_INPUTS, (), {"beta": 0.05}, "-Σ (A·lp - beta/2·(lp - old_lp)²)"),
        LossSpec("gspo", _RL_INPUTS, (_SEQUENCE_RATIO_MASK,), _CLIP_DEFAULTS, "-Σ min(s·A, clip(s, lo, hi)·A)"),
        LossSpec("stable_reinforce", _RL_INPUTS, (), _TRUST_REGION,
                 "-Σ [lo ≤ ratio ≤ hi]·sg(ratio)·A·lp + kl_coeff·Σ (ratio - 1 - log ratio)"),
    )
}

# The SDK's `custom` loss runs a loss uploaded with the SDK's LossHandle on the server; Twinkle runs none.
_UNSUPPORTED_LOSSES = {
    "custom": "Uploaded (server-side) custom losses are not supported by this server. Pass a Python function "
              "to forward_backward_custom instead: the SDK then computes it on your machine.",
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
    if spec is None and loss_fn in _UNSUPPORTED_LOSSES:
        raise InvalidRequest(f"loss_fn {loss_fn!r} is not supported.", hint=_UNSUPPORTED_LOSSES[loss_fn])
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
    """The arrays the loss reads, with optional inputs defaulted (weights → ones; sequence_ratio_mask →
    the positions with a nonzero advantage)."""
    spec = loss_spec(loss_fn)
    resolved = {key: np.asarray(inputs[key]) for key in spec.required_inputs}
    target_shape = resolved["target_tokens"].shape
    for key in spec.optional_inputs:
        value = inputs.get(key)
        if value is not None:
            resolved[key] = np.asarray(value)
        elif key == _SEQUENCE_RATIO_MASK:
            resolved[key] = (np.asarray(resolved["advantages"]) != 0).astype(np.float32)
        else:
            resolved[key] = np.ones(target_shape, np.float32)
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
    loss_fn: str,
    lp: np.ndarray,
    inputs: Mapping[str, np.ndarray],
    config: Mapping[str, float | str] | None,
    segments: Sequence[int] | None = None,
) -> ElementwiseLoss:
    """Per-token loss and dloss/dlp of `loss_fn` at target logprobs `lp` (the formulas in the module doc).

    `inputs` are the datum's `loss_fn_inputs`; several datums may be concatenated, with `segments` their
    sizes in order (default: one datum). Every loss but gspo is a sum of per-token terms; gspo's sequence
    ratio is per datum. Computation happens in the dtype of `lp`.
    """
    resolved_config = resolve_config(loss_fn, config)
    arrays = {
        key: value.astype(lp.dtype, copy=False)
        for key, value in loss_inputs(loss_fn, inputs).items()
        if key != "target_tokens"
    }
    if loss_fn != "gspo":
        return _IMPLEMENTATIONS[loss_fn](lp, arrays, resolved_config)
    bounds = np.cumsum([0, *(segments if segments is not None else [lp.size])])
    if bounds[-1] != lp.size:
        raise ValueError(f"segments sum to {bounds[-1]} but lp has {lp.size} values")
    parts = [
        _gspo(lp.ravel()[a:b], {k: v.ravel()[a:b] for k, v in arrays.items()}, resolved_config)
        for a, b in itertools.pairwise(bounds)
    ]
    return ElementwiseLoss(
        np.concatenate([p.loss for p in parts]).reshape(lp.shape).astype(lp.dtype, copy=False),
        np.concatenate([p.dloss_dlp for p in parts]).reshape(lp.shape).astype(lp.dtype, copy=False),
        {"clipped_tokens:sum": float(sum(p.metrics["clipped_tokens:sum"] for p in parts))},
    )


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


def _gspo(lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> ElementwiseLoss:
    """One datum (the sequence ratio is the datum's own)."""
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    in_ratio = x[_SEQUENCE_RATIO_MASK] != 0
    log_ratio = (lp - x["logprobs"])[in_ratio].astype(np.float64).mean() if in_ratio.any() else 0.0
    ratio = np.full_like(lp, np.exp(log_ratio))  # every token carries the sequence ratio's value
    advantages = x["advantages"]
    unclipped = ratio * advantages
    clipped = np.clip(ratio, low, high) * advantages
    flat = clipped < unclipped  # as in ppo: strictly smaller only outside [lo, hi], where the slope is 0
    grad = np.where(flat, 0.0, -unclipped).astype(lp.dtype, copy=False)
    return ElementwiseLoss(-np.minimum(unclipped, clipped), grad, {"clipped_tokens:sum": float(np.count_nonzero(flat))})


def _stable_reinforce(lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> ElementwiseLoss:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    kl_coeff = lp.dtype.type(config["kl_coeff"])
    advantages = x["advantages"]
    log_ratio = lp - x["logprobs"]
    ratio = np.exp(log_ratio)
    sampled = (advantages != 0) | (x["logprobs"] != 0)
    trusted = (ratio >= low) & (ratio <= high)
    weight = np.where(trusted, ratio * advantages, 0).astype(lp.dtype, copy=False)  # held constant
    kl = np.where(sampled, ratio - 1 - log_ratio, 0).astype(lp.dtype, copy=False)
    loss = -weight * lp + kl_coeff * kl
    grad = -weight + kl_coeff * np.where(sampled, ratio - 1, 0).astype(lp.dtype, copy=False)
    dropped = np.count_nonzero(~trusted & (advantages != 0))
    return ElementwiseLoss(loss, grad, {"clipped_tokens:sum": float(dropped)})


_Implementation = Callable[[np.ndarray, dict[str, np.ndarray], dict[str, float]], ElementwiseLoss]
_IMPLEMENTATIONS: dict[str, _Implementation] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
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
    for key in ("beta", "kl_coeff"):
        if merged.get(key, 0.0) < 0:
            problems.append(f"{key} must be >= 0, got {merged[key]}")
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
