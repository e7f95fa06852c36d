from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from twinkle import losses as reference
from twinkle.backends import torch_losses
from twinkle.backends.torch_losses import LossBatch
from twinkle.errors import InvalidRequest
from twinkle.types import Datum, chunks_from_tokens

B, T = 3, 10


def _padded_case(seed: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """Random lp and RL/CE inputs for B rows of different lengths (the tail of each row is padding)."""
    rng = np.random.default_rng(seed)
    lp = rng.uniform(-4, -0.1, (B, T))
    inputs = {
        "weights": rng.uniform(0, 2, (B, T)),
        # Sampling logprobs near lp, so ratios fall both inside and outside the [0.8, 1.2] clip range.
        "logprobs": lp + rng.uniform(-0.5, 0.5, (B, T)),
        "advantages": rng.normal(size=(B, T)),
    }
    mask = np.zeros((B, T), bool)
    for row, length in enumerate((T, 7, 4)):
        mask[row, :length] = True
    for values in inputs.values():
        values[~mask] = 0.0
    return lp, inputs, mask


def _row_inputs(inputs: dict[str, np.ndarray], mask: np.ndarray, row: int) -> dict[str, np.ndarray]:
    arrays = {key: values[row][mask[row]] for key, values in inputs.items()}
    return {**arrays, "target_tokens": np.zeros(int(mask[row].sum()), np.int64)}


def _torch_loss(loss_fn: str, lp: np.ndarray, inputs: dict[str, np.ndarray], mask: np.ndarray, config: dict):
    lp_tensor = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    batch = LossBatch(lp_tensor, {k: torch.tensor(v) for k, v in inputs.items()}, torch.tensor(mask))
    terms = torch_losses.compute_loss(loss_fn, batch, reference.resolve_config(loss_fn, config))
    terms.total.backward()
    assert lp_tensor.grad is not None
    return terms, lp_tensor.grad.numpy()


@pytest.mark.parametrize(
    "loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
)
@pytest.mark.parametrize(
    "config", [{}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05, "beta": 0.3, "kl_coeff": 0.2}]
)
def test_tinker_losses_match_the_numpy_reference_in_loss_gradient_and_metrics(loss_fn: str, config: dict) -> None:
    lp, inputs, mask = _padded_case(seed=3)
    config = {key: value for key, value in config.items() if key in reference.LOSS_FUNCTIONS[loss_fn].config_defaults}

    terms, grad = _torch_loss(loss_fn, lp, inputs, mask, config)

    rows = [
        reference.elementwise_loss_and_grad(loss_fn, lp[r][mask[r]], _row_inputs(inputs, mask, r), config)
        for r in range(B)
    ]
    expected_total = sum(float(row.loss.sum()) for row in rows)
    assert terms.total.item() == pytest.approx(expected_total, rel=1e-12, abs=1e-12)
    for r, row in enumerate(rows):
        np.testing.assert_allclose(grad[r][mask[r]], row.dloss_dlp, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(terms.elementwise.numpy()[r][mask[r]], row.loss, rtol=1e-12, atol=1e-12)
    assert not grad[~mask].any() and not terms.elementwise.numpy()[~mask].any()
    expected_metrics: dict[str, float] = {}
    for row in rows:
        for key, value in row.metrics.items():
            expected_metrics[key] = expected_metrics.get(key, 0.0) + value
    assert terms.metrics == expected_metrics


def test_ppo_clips_some_tokens_in_the_comparison_case() -> None:
    lp, inputs, mask = _padded_case(seed=3)
    terms, _ = _torch_loss("ppo", lp, inputs, mask, {})
    assert 0 < terms.metrics["clipped_tokens:sum"] < mask.sum()


def test_cross_entropy_accepts_top_k_targets() -> None:
    lp = torch.full((1, 2, 3), -1.0, requires_grad=True)
    weights = torch.tensor([[[1.0, 0.5, 0.0], [2.0, 0.0, 0.0]]])
    batch = LossBatch(lp, {"weights": weights}, torch.tensor([[True, False]]))

    terms = torch_losses.compute_loss("cross_entropy", batch, {})

    assert terms.total.item() == pytest.approx(1.5)  # the padded second position counts for nothing
    assert terms.elementwise.shape == (1, 2, 3)


def _dpo_batch(policy: list[list[float]], ref: list[list[float]], weights: list[list[float]]) -> LossBatch:
    lp = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    return LossBatch(
        lp,
        {"weights": torch.tensor(weights, dtype=torch.float64)},
        torch.ones(lp.shape, dtype=torch.bool),
        reference_lp=torch.tensor(ref, dtype=torch.float64),
    )


def test_dpo_is_the_sigmoid_loss_of_the_reward_margin() -> None:
    beta = 0.1
    policy = [[-1.0, -0.5, -0.2], [-1.0, -2.0, -3.0], [-0.3, -0.3, -0.3], [-0.1, -0.1, -0.1]]
    ref = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-0.5, -0.5, -0.5], [-0.5, -0.5, -0.5]]
    weights = [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    batch = _dpo_batch(policy, ref, weights)

    terms = torch_losses.compute_loss("dpo", batch, {"beta": beta})

    chosen = [beta * (0.5 + 0.8), beta * 0.2]
    rejected = [beta * (-1.0 - 2.0), beta * 0.4]
    expected = sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected, strict=True))
    assert terms.total.item() == pytest.approx(expected, rel=1e-12)
    assert float(terms.elementwise.sum()) == pytest.approx(expected, rel=1e-12)
    assert terms.metrics["dpo_rewards/chosen:mean"] == pytest.approx(np.mean(chosen))
    assert terms.metrics["dpo_rewards/rejected:mean"] == pytest.approx(np.mean(rejected))
    assert terms.metrics["dpo_accuracy:mean"] == 0.5
    assert terms.metrics["dpo_margin:mean"] == pytest.approx(np.mean(np.subtract(chosen, rejected)))
    terms.total.backward()
    assert batch.lp.grad is not None
    # Prompt tokens (weight 0) get no gradient; chosen completions are pushed up, rejected ones down.
    assert not batch.lp.grad[:, 0].any()
    assert (batch.lp.grad[0::2, 2] < 0).all() and (batch.lp.grad[1::2, 2] > 0).all()


def test_grpo_without_kl_is_ppo_and_with_kl_adds_the_k3_estimate() -> None:
    lp, inputs, mask = _padded_case(seed=5)
    ppo, ppo_grad = _torch_loss("ppo", lp, inputs, mask, {})
    batch_inputs = {k: torch.tensor(v) for k, v in inputs.items()}
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "kl_beta": 0.0}

    plain = torch_losses.compute_loss("grpo", LossBatch(torch.tensor(lp), batch_inputs, torch.tensor(mask)), config)
    assert plain.total.item() == pytest.approx(ppo.total.item(), rel=1e-12)

    ref = lp + 0.3
    lp_tensor = torch.tensor(lp, requires_grad=True)
    kl_batch = LossBatch(lp_tensor, batch_inputs, torch.tensor(mask), reference_lp=torch.tensor(ref))
    with_kl = torch_losses.compute_loss("grpo", kl_batch, {**config, "kl_beta": 0.5})
    with_kl.total.backward()

    kl_mask = mask & (inputs["weights"] > 0)
    kl = np.exp(0.3) - 0.3 - 1
    assert with_kl.total.item() == pytest.approx(ppo.total.item() + 0.5 * kl * kl_mask.sum(), rel=1e-10)
    assert with_kl.metrics["kl:mean"] == pytest.approx(kl)
    assert lp_tensor.grad is not None
    expected_grad = ppo_grad + np.where(kl_mask, 0.5 * (1 - np.exp(0.3)), 0.0)
    np.testing.assert_allclose(lp_tensor.grad.numpy(), expected_grad, rtol=1e-10, atol=1e-12)


def _datum(length: int, **inputs: np.ndarray) -> Datum:
    return Datum(chunks_from_tokens(np.arange(length)), {"target_tokens": np.arange(length), **inputs})


def test_dpo_rejects_an_odd_number_of_datums() -> None:
    with pytest.raises(InvalidRequest, match="odd number"):
        torch_losses.validate("dpo", [_datum(3), _datum(3), _datum(3)], {})


def test_grpo_reports_missing_inputs_and_unknown_config_keys_together() -> None:
    with pytest.raises(InvalidRequest) as raised:
        torch_losses.validate("grpo", [_datum(3)], {"epsilon": 0.2})
    assert "epsilon" in str(raised.value) and "advantages" in str(raised.value)


def test_unknown_loss_names_every_supported_loss() -> None:
    with pytest.raises(InvalidRequest) as raised:
        torch_losses.validate("sft", [_datum(3)], {})
    for name in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "dpo", "grpo"):
        assert name in str(raised.value)


def test_grpo_kl_mask_defaults_to_tokens_with_a_sampling_logprob() -> None:
    datum = _datum(4, logprobs=np.array([0.0, 0.0, -0.5, -1.0]), advantages=np.ones(4))
    assert torch_losses.datum_inputs("grpo", datum)["weights"].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_gspo_reads_an_explicit_sequence_ratio_mask_like_the_reference() -> None:
    lp, inputs, mask = _padded_case(seed=5)
    ratio_mask = (np.random.default_rng(6).random((B, T)) > 0.4).astype(np.float64)
    ratio_mask[:, 0] = 1.0
    ratio_mask[~mask] = 0.0
    inputs = {**inputs, "sequence_ratio_mask": ratio_mask}

    terms, grad = _torch_loss("gspo", lp, inputs, mask, {"clip_high_threshold": 1.1})

    for r in range(B):
        row = reference.elementwise_loss_and_grad(
            "gspo", lp[r][mask[r]], _row_inputs(inputs, mask, r), {"clip_high_threshold": 1.1})
        np.testing.assert_allclose(grad[r][mask[r]], row.dloss_dlp, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(terms.elementwise.numpy()[r][mask[r]], row.loss, rtol=1e-12, atol=1e-12)
