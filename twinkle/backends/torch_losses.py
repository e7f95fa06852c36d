"""Loss functions in torch, over padded batches of per-token target logprobs.

The Tinker losses (`cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`, `gspo`,
`stable_reinforce`) mirror the numpy reference in `twinkle.losses` term for term, metrics included.
Twinkle adds two losses that look at a reference policy, the base model with the tenant's adapter disabled:

    dpo   datums come in pairs [chosen_1, rejected_1, chosen_2, ...] of cross-entropy style datums whose
          `weights` mark the completion. With s = Σ w·lp and s_ref the same under the reference,
          r = beta·(s - s_ref) and L = -Σ_pairs log σ(r_chosen - r_rejected)            (beta = 0.1)
    grpo  ppo's clipped objective plus kl_beta·KL(policy ‖ reference) per token, with the k3 estimator
          exp(ref - lp) - (ref - lp) - 1, on tokens with positive `weights`, or when no weights are sent,
          on tokens with a nonzero sampling logprob (prompt positions carry 0)        (kl_beta = 0.0)

Every loss returns the summed loss, the per-token `elementwise_loss` (zero on padding; for dpo each pair's
loss is spread over its completion tokens by weight) and extra metrics keyed `name:reduction`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from twinkle import losses as reference
from twinkle.errors import InvalidRequest
from twinkle.types import Datum, input_length

Tensor = torch.Tensor

TWINKLE_LOSSES: dict[str, reference.LossSpec] = {
    "dpo": reference.LossSpec(
        "dpo", ("target_tokens",), ("weights",), {"beta": 0.1}, "-Σ_pairs log σ(r_chosen - r_rejected)"
    ),
    "grpo": reference.LossSpec(
        "grpo",
        ("target_tokens", "logprobs", "advantages"),
        ("weights",),
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "kl_beta": 0.0},
        "ppo + kl_beta·KL(policy ‖ reference)",
    ),
}


def loss_names() -> list[str]:
    return [*reference.LOSS_FUNCTIONS, *TWINKLE_LOSSES]


@dataclass
class LossTerms:
    """What one loss evaluation produces for a padded batch."""

    total: Tensor  # scalar: the summed loss, differentiable
    elementwise: Tensor  # shape of lp, detached, zero on padding
    metrics: dict[str, float]


@dataclass
class LossBatch:
    """Padded per-token tensors: `lp` is [B, T] or [B, T, K]; `inputs` have lp's shape; `mask` is [B, T]."""

    lp: Tensor
    inputs: dict[str, Tensor]
    mask: Tensor
    reference_lp: Tensor | None = None

    def token_mask(self) -> Tensor:
        """The padding mask broadcast to lp's shape, as lp's dtype."""
        mask = self.mask.to(self.lp.dtype)
        return mask.unsqueeze(-1).expand_as(self.lp) if self.lp.dim() == 3 else mask


def validate(loss_fn: str, data: list[Datum], config: Mapping[str, float | str] | None) -> dict[str, float]:
    """Check the batch for `loss_fn` and return its config with defaults; InvalidRequest lists every problem."""
    if loss_fn in reference.LOSS_FUNCTIONS:
        reference.validate_loss(loss_fn, data, config)
        return reference.resolve_config(loss_fn, config)
    spec = TWINKLE_LOSSES.get(loss_fn)
    if spec is None:
        raise InvalidRequest(
            f"Unknown loss_fn {loss_fn!r}.", hint=f"Supported loss functions: {', '.join(loss_names())}."
        )
    problems = _config_problems(spec, config or {})
    if not data:
        problems.append("the batch has no datums")
    if loss_fn == "dpo" and len(data) % 2:
        problems.append(f"dpo needs pairs [chosen, rejected, ...], got {len(data)} datums (an odd number)")
    for index, datum in enumerate(data):
        problems.extend(f"datum {index}: {problem}" for problem in _datum_problems(spec, datum))
    if problems:
        raise InvalidRequest(f"Invalid {loss_fn} request: " + "; ".join(problems[:10]) + ".", problems=len(problems))
    return {**spec.config_defaults, **{key: float(value) for key, value in (config or {}).items()}}


def datum_inputs(loss_fn: str, datum: Datum) -> dict[str, np.ndarray]:
    """The arrays `loss_fn` reads from one datum, optional ones defaulted (weights → ones)."""
    if loss_fn in reference.LOSS_FUNCTIONS:
        return reference.loss_inputs(loss_fn, datum.loss_fn_inputs)
    spec = TWINKLE_LOSSES[loss_fn]
    arrays = {key: np.asarray(datum.loss_fn_inputs[key]) for key in spec.required_inputs}
    if "weights" in datum.loss_fn_inputs:
        arrays["weights"] = np.asarray(datum.loss_fn_inputs["weights"])
    elif loss_fn == "dpo":
        arrays["weights"] = np.ones(arrays["target_tokens"].shape, np.float32)
    else:  # grpo: the KL mask defaults to the sampled tokens, the ones with a sampling logprob
        arrays["weights"] = (arrays["logprobs"] != 0).astype(np.float32)
    return arrays


def needs_reference(loss_fn: str, config: Mapping[str, float]) -> bool:
    """Whether the loss reads the reference policy's logprobs (a second forward with the adapter off)."""
    return loss_fn == "dpo" or (loss_fn == "grpo" and config["kl_beta"] != 0.0)


def compute_loss(loss_fn: str, batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    """Evaluate `loss_fn` (already validated) on a padded batch."""
    return _LOSSES[loss_fn](batch, config)


def _masked(batch: LossBatch, per_token: Tensor, metrics: dict[str, float]) -> LossTerms:
    per_token = per_token * batch.token_mask()
    return LossTerms(per_token.sum(), per_token.detach(), metrics)


def _cross_entropy(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    return _masked(batch, -batch.inputs["weights"] * batch.lp, {})


def _importance_sampling(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    ratio = torch.exp(batch.lp - batch.inputs["logprobs"])
    return _masked(batch, -ratio * batch.inputs["advantages"], {})


def _clipped_objective(
    batch: LossBatch, config: Mapping[str, float], ratio: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """PPO's per-token loss (of the token ratio, or of `ratio` when given) and the mask of tokens whose
    clipped branch was chosen and is flat."""
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    advantages = batch.inputs["advantages"]
    if ratio is None:
        ratio = torch.exp(batch.lp - batch.inputs["logprobs"])
    unclipped = ratio * advantages
    clipped = ratio.clamp(low, high) * advantages
    # Same branch rule as the numpy reference: on ties the unclipped branch is exact.
    takes_clipped = clipped < unclipped
    flat = takes_clipped & ((ratio < low) | (ratio > high))
    return -torch.where(takes_clipped, clipped, unclipped), flat


def _ppo(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    per_token, flat = _clipped_objective(batch, config)
    return _masked(batch, per_token, {"clipped_tokens:sum": _count(flat, batch)})


def _cispo(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio = torch.exp(batch.lp - batch.inputs["logprobs"]).detach()
    coefficient = ratio.clamp(low, high) * batch.inputs["advantages"]
    outside = (ratio < low) | (ratio > high)
    return _masked(batch, -coefficient * batch.lp, {"clipped_tokens:sum": _count(outside, batch)})


def _dro(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    drift = batch.lp - batch.inputs["logprobs"]
    per_token = -(batch.inputs["advantages"] * batch.lp - config["beta"] / 2 * drift * drift)
    return _masked(batch, per_token, {})


def _gspo(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    lp = batch.lp
    dims = tuple(range(1, lp.dim()))
    marked = batch.inputs.get("sequence_ratio_mask", batch.inputs["advantages"])  # default as in the reference
    in_ratio = (marked != 0).to(lp.dtype) * batch.token_mask()
    count = in_ratio.sum(dim=dims, keepdim=True)
    drift = ((lp.detach() - batch.inputs["logprobs"]) * in_ratio).sum(dim=dims, keepdim=True)
    log_ratio = drift / count.clamp_min(1)  # a datum with no marked position has ratio 1
    # Every token carries the sequence ratio's value with its own logprob's gradient.
    ratio = torch.exp(log_ratio + lp - lp.detach())
    per_token, flat = _clipped_objective(batch, config, ratio)
    return _masked(batch, per_token, {"clipped_tokens:sum": _count(flat, batch)})


def _stable_reinforce(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    advantages, sampling = batch.inputs["advantages"], batch.inputs["logprobs"]
    log_ratio = batch.lp - sampling
    ratio = torch.exp(log_ratio)
    held = ratio.detach()
    trusted = (held >= low) & (held <= high)
    weight = torch.where(trusted, held * advantages, torch.zeros_like(held))
    sampled = (advantages != 0) | (sampling != 0)
    kl = torch.where(sampled, ratio - 1 - log_ratio, torch.zeros_like(ratio))
    per_token = -weight * batch.lp + config["kl_coeff"] * kl
    return _masked(batch, per_token, {"clipped_tokens:sum": _count(~trusted & (advantages != 0), batch)})


def _dpo(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    if batch.reference_lp is None:
        raise ValueError("dpo needs reference logprobs")
    weights = batch.inputs["weights"] * batch.token_mask()
    reward = config["beta"] * ((weights * (batch.lp - batch.reference_lp)).sum(dim=-1))
    chosen, rejected = reward[0::2], reward[1::2]
    pair_loss = F.softplus(-(chosen - rejected))  # = -log σ(chosen - rejected)
    elementwise = _spread_over_pairs(pair_loss.detach(), weights.detach(), batch.token_mask())
    margin = (chosen - rejected).detach()
    metrics = {
        "dpo_rewards/chosen:mean": float(chosen.detach().mean()),
        "dpo_rewards/rejected:mean": float(rejected.detach().mean()),
        "dpo_accuracy:mean": float((margin > 0).float().mean()),
        "dpo_margin:mean": float(margin.mean()),
    }
    return LossTerms(pair_loss.sum(), elementwise, metrics)


def _spread_over_pairs(pair_loss: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """Per-token shares of each pair's loss, proportional to weight (uniform when a pair has no weight)."""
    pair_weights = weights.view(-1, 2, weights.shape[-1])
    pair_mask = mask.view(-1, 2, mask.shape[-1])
    totals = pair_weights.sum(dim=(1, 2), keepdim=True)
    shares = torch.where(
        totals > 0, pair_weights / totals.clamp_min(1e-30), pair_mask / pair_mask.sum(dim=(1, 2), keepdim=True)
    )
    return (shares * pair_loss.view(-1, 1, 1)).reshape(weights.shape)


def _grpo(batch: LossBatch, config: Mapping[str, float]) -> LossTerms:
    per_token, flat = _clipped_objective(batch, config)
    metrics = {"clipped_tokens:sum": _count(flat, batch)}
    kl_beta = config["kl_beta"]
    if kl_beta != 0.0:
        if batch.reference_lp is None:
            raise ValueError("grpo with kl_beta needs reference logprobs")
        kl_mask = (batch.inputs["weights"] > 0).to(batch.lp.dtype) * batch.token_mask()
        log_ratio = batch.reference_lp - batch.lp
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token = per_token + kl_beta * kl * kl_mask
        metrics["kl:mean"] = float((kl.detach() * kl_mask).sum() / kl_mask.sum().clamp_min(1))
    return _masked(batch, per_token, metrics)


def _count(flags: Tensor, batch: LossBatch) -> float:
    return float((flags & batch.token_mask().bool()).sum())


_LOSSES: dict[str, Callable[[LossBatch, Mapping[str, float]], LossTerms]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
    "dpo": _dpo,
    "grpo": _grpo,
}


def _config_problems(spec: reference.LossSpec, config: Mapping[str, float | str]) -> list[str]:
    problems = []
    for key, value in config.items():
        if key not in spec.config_defaults:
            problems.append(f"unknown loss_fn_config key {key!r} (accepted keys: {', '.join(spec.config_defaults)})")
        elif isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
            problems.append(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    if problems:
        return problems
    merged = {**spec.config_defaults, **{key: float(value) for key, value in config.items()}}
    if "clip_low_threshold" in merged and not 0 <= merged["clip_low_threshold"] <= merged["clip_high_threshold"]:
        problems.append("clip thresholds must satisfy 0 <= clip_low_threshold <= clip_high_threshold")
    for key in ("beta", "kl_beta"):
        if merged.get(key, 0.0) < 0:
            problems.append(f"{key} must be >= 0, got {merged[key]}")
    return problems


def _datum_problems(spec: reference.LossSpec, datum: Datum) -> list[str]:
    inputs = datum.loss_fn_inputs
    missing = [key for key in spec.required_inputs if key not in inputs]
    if missing:
        return [f"loss_fn_inputs lacks {', '.join(map(repr, missing))} (required by {spec.name})"]
    targets = np.asarray(inputs["target_tokens"])
    if targets.dtype.kind not in "iu" or targets.ndim != 1:
        return [f"target_tokens must be a 1-D integer array, got {targets.dtype} {list(targets.shape)}"]
    problems = []
    token_count = input_length(datum.model_input)
    if targets.shape[0] != token_count:
        problems.append(f"target_tokens has {targets.shape[0]} positions but model_input has {token_count} tokens")
    for key in (*spec.required_inputs[1:], *spec.optional_inputs):
        if key in inputs:
            values = np.asarray(inputs[key])
            if values.shape != targets.shape:
                problems.append(f"{key} has shape {list(values.shape)} but target_tokens has {list(targets.shape)}")
            elif values.dtype.kind not in "iuf" or not np.isfinite(values).all():
                problems.append(f"{key} must hold finite numbers")
    return problems
