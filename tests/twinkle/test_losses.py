from __future__ import annotations

import numpy as np
import pytest

from twinkle import losses
from twinkle.errors import InvalidRequest
from twinkle.types import Datum, chunks_from_tokens

T = 12


def _inputs(rng: np.random.Generator, lp: np.ndarray) -> dict[str, np.ndarray]:
    # Sampling logprobs near lp, so ratios fall both inside and outside the [0.8, 1.2] clip range.
    return {
        "target_tokens": rng.integers(0, 50, T),
        "weights": rng.uniform(0, 2, T),
        "logprobs": lp + rng.uniform(-0.5, 0.5, T),
        "advantages": rng.normal(size=T),
    }


def _finite_difference(f: object, lp: np.ndarray, step: float = 1e-6) -> np.ndarray:
    grad = np.empty_like(lp)
    for i in range(len(lp)):
        bump = np.zeros_like(lp)
        bump[i] = step
        grad[i] = (f(lp + bump) - f(lp - bump)) / (2 * step)  # type: ignore[operator]
    return grad


def _away_from_clip_edges(lp: np.ndarray, old: np.ndarray) -> bool:
    ratio = np.exp(lp - old)
    return bool(np.min(np.abs(ratio - 0.8)) > 1e-3 and np.min(np.abs(ratio - 1.2)) > 1e-3)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "dro"])
def test_gradient_matches_finite_differences(loss_fn: str) -> None:
    rng = np.random.default_rng(1)
    lp = rng.uniform(-4, -0.1, T)
    inputs = _inputs(rng, lp)
    assert _away_from_clip_edges(lp, inputs["logprobs"])

    _, grad, _ = losses.loss_and_grad(loss_fn, lp, inputs, {})

    expected = _finite_difference(lambda x: losses.loss_and_grad(loss_fn, x, inputs, {})[0], lp)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-8)


def test_cispo_gradient_holds_the_clipped_ratio_constant() -> None:
    rng = np.random.default_rng(2)
    lp = rng.uniform(-4, -0.1, T)
    inputs = _inputs(rng, lp)
    assert _away_from_clip_edges(lp, inputs["logprobs"])

    _, grad, metrics = losses.loss_and_grad("cispo", lp, inputs, {})

    # Moving the sampling logprobs along with lp keeps the ratio fixed: what stopgrad means.
    def loss_at(x: np.ndarray) -> float:
        shifted = {**inputs, "logprobs": inputs["logprobs"] + (x - lp)}
        return losses.loss_and_grad("cispo", x, shifted, {})[0]

    np.testing.assert_allclose(grad, _finite_difference(loss_at, lp), rtol=1e-6, atol=1e-8)
    assert 0 < metrics["clipped_tokens:sum"] < T


def test_losses_follow_the_documented_formulas() -> None:
    lp = np.array([-1.0, -2.0, -0.5])
    old = np.array([-1.0, -2.5, -0.1])
    adv = np.array([1.0, 2.0, -1.0])
    ratio = np.exp(lp - old)
    inputs = {"target_tokens": np.zeros(3, np.int64), "logprobs": old, "advantages": adv}

    assert losses.loss_and_grad("importance_sampling", lp, inputs, {})[0] == pytest.approx(
        -(ratio * adv).sum()
    )
    ppo = -np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv).sum()
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    assert losses.loss_and_grad("ppo", lp, inputs, config)[0] == pytest.approx(ppo)
    cispo = -(np.clip(ratio, 0.8, 1.2) * adv * lp).sum()
    assert losses.loss_and_grad("cispo", lp, inputs, {})[0] == pytest.approx(cispo)
    dro = -(adv * lp - 0.1 / 2 * (lp - old) ** 2).sum()
    assert losses.loss_and_grad("dro", lp, inputs, {"beta": 0.1})[0] == pytest.approx(dro)


def test_ppo_gives_no_gradient_where_the_clipped_term_wins() -> None:
    lp = np.log(np.array([1.5, 1.5, 0.5, 0.5, 1.0]))
    inputs = {
        "target_tokens": np.zeros(5, np.int64),
        "logprobs": np.zeros(5),
        "advantages": np.array([1.0, -1.0, 1.0, -1.0, 1.0]),
    }

    _, grad, metrics = losses.loss_and_grad("ppo", lp, inputs, {})

    # ratio 1.5 with A>0 and ratio 0.5 with A<0 are clipped (flat); the others keep -ratio·A.
    np.testing.assert_allclose(grad, [0.0, 1.5, -0.5, 0.0, -1.0])
    assert metrics == {"clipped_tokens:sum": 2.0}


def test_cross_entropy_weights_default_to_ones() -> None:
    lp = np.array([-1.0, -2.0])

    loss, grad, _ = losses.loss_and_grad("cross_entropy", lp, {"target_tokens": np.array([1, 2])}, None)

    assert loss == pytest.approx(3.0)
    np.testing.assert_array_equal(grad, [-1.0, -1.0])


def _datum(length: int, **inputs: object) -> Datum:
    return Datum(chunks_from_tokens(list(range(length))), {k: np.asarray(v) for k, v in inputs.items()})


def test_unknown_loss_lists_the_supported_ones() -> None:
    with pytest.raises(InvalidRequest) as error:
        losses.validate_loss("hinge", [_datum(2, target_tokens=[1, 2])], {})

    assert "hinge" in str(error.value)
    for name in losses.LOSS_FUNCTIONS:
        assert name in str(error.value)


def test_validate_loss_names_the_missing_input() -> None:
    datum = _datum(2, target_tokens=[1, 2], advantages=[1.0, 1.0])

    with pytest.raises(InvalidRequest, match="'logprobs'"):
        losses.validate_loss("ppo", [datum], {})


@pytest.mark.parametrize("key", ["target_tokens", "weights"])
def test_validate_loss_rejects_lengths_that_differ_from_the_model_input(key: str) -> None:
    inputs = {"target_tokens": [1, 2, 3], "weights": [1.0, 1.0, 1.0]}
    inputs[key] = inputs[key][:2]  # type: ignore[index]

    with pytest.raises(InvalidRequest, match=r"datum 0: .*(3 tokens|shape)"):
        losses.validate_loss("cross_entropy", [_datum(3, **inputs)], {})


def test_validate_loss_rejects_non_finite_values() -> None:
    datum = _datum(2, target_tokens=[1, 2], logprobs=[-1.0, np.nan], advantages=[np.inf, 0.0])

    with pytest.raises(InvalidRequest) as error:
        losses.validate_loss("importance_sampling", [datum], {})

    assert "logprobs has 1 non-finite" in str(error.value)
    assert "advantages has 1 non-finite" in str(error.value)


def test_validate_loss_rejects_unknown_config_keys_and_names_the_accepted_ones() -> None:
    datum = _datum(2, target_tokens=[1, 2], logprobs=[-1.0, -1.0], advantages=[1.0, 0.0])

    with pytest.raises(InvalidRequest, match=r"'beta'.*clip_low_threshold, clip_high_threshold"):
        losses.validate_loss("ppo", [datum], {"beta": 0.1})
    with pytest.raises(InvalidRequest, match="clip_low_threshold <= clip_high_threshold"):
        losses.validate_loss("ppo", [datum], {"clip_low_threshold": 1.5})
    with pytest.raises(InvalidRequest, match="finite number"):
        losses.validate_loss("dro", [datum], {"beta": "high"})


def test_validate_loss_reports_every_problem_at_once() -> None:
    data = [_datum(2, target_tokens=[1]), _datum(2, weights=[1.0, 1.0]), _datum(1, target_tokens=[0.5])]

    with pytest.raises(InvalidRequest) as error:
        losses.validate_loss("cross_entropy", data, {"temperature": 1.0})

    message = str(error.value)
    assert "datum 0" in message and "datum 1" in message and "datum 2" in message
    assert "temperature" in message
    assert error.value.details["problems"] == 4


def test_validate_loss_accepts_well_formed_batches_including_top_k_targets() -> None:
    flat = _datum(3, target_tokens=[1, 2, 3])
    top_k = _datum(3, target_tokens=np.zeros((3, 2), np.int64), weights=np.ones((3, 2), np.float32))
    rl = _datum(2, target_tokens=[1, 2], logprobs=[-1.0, -2.0], advantages=[0.5, 0.5])

    losses.validate_loss("cross_entropy", [flat, top_k], None)
    losses.validate_loss("cispo", [rl], {"clip_low_threshold": 0.5, "clip_high_threshold": 2})


def test_empty_batch_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="no datums"):
        losses.validate_loss("cross_entropy", [], {})


def _gspo_reference(lp: np.ndarray, old: np.ndarray, adv: np.ndarray, mask: np.ndarray,
                    low: float = 0.8, high: float = 1.2) -> tuple[float, np.ndarray]:
    """The Tinker docs' GSPO-token, written out for one datum: (loss, dloss/dlp)."""
    seq_ratio = np.exp((lp - old)[mask != 0].mean())
    objective = np.minimum(seq_ratio * adv, np.clip(seq_ratio, low, high) * adv)
    # d(s_t)/d(lp_t) = s (value of the sequence ratio, gradient of the token's own logprob); the clipped
    # branch is flat outside [low, high].
    clipped_wins = np.clip(seq_ratio, low, high) * adv < seq_ratio * adv
    return float(-objective.sum()), np.where(clipped_wins, 0.0, -seq_ratio * adv)


def test_gspo_follows_the_documented_sequence_ratio_per_datum() -> None:
    rng = np.random.default_rng(3)
    lengths = [5, 7]
    lp = rng.uniform(-3, -0.1, sum(lengths))
    old = lp + rng.uniform(-0.3, 0.3, lp.size)
    adv = np.repeat(rng.normal(size=2), lengths)
    mask = (rng.random(lp.size) > 0.3).astype(np.float32)
    mask[0] = mask[5] = 1.0
    inputs = {"target_tokens": np.zeros(lp.size, np.int64), "logprobs": old, "advantages": adv,
              "sequence_ratio_mask": mask}

    result = losses.elementwise_loss_and_grad("gspo", lp, inputs, {}, segments=lengths)

    expected = [_gspo_reference(lp[a:b], old[a:b], adv[a:b], mask[a:b]) for a, b in ((0, 5), (5, 12))]
    assert result.loss.sum() == pytest.approx(sum(loss for loss, _ in expected))
    np.testing.assert_allclose(result.dloss_dlp, np.concatenate([grad for _, grad in expected]), rtol=1e-12)
    # One sequence ratio over both datums would be a different number: the ratio really is per datum.
    joint = losses.elementwise_loss_and_grad("gspo", lp, inputs, {})
    assert joint.loss.sum() != pytest.approx(result.loss.sum())


def test_gspo_clips_whole_sequences_and_defaults_its_mask_to_the_trained_positions() -> None:
    # Prompt positions: advantage 0 and a padded sampling logprob of 0, which must not enter the ratio.
    lp = np.array([-5.0, -4.0, -1.0, -1.0])
    old = np.array([0.0, 0.0, -1.5, -1.5])  # sequence ratio e^0.5 ≈ 1.65, outside [0.8, 1.2]
    adv = np.array([0.0, 0.0, 1.0, 1.0])
    inputs = {"target_tokens": np.zeros(4, np.int64), "logprobs": old, "advantages": adv}

    result = losses.elementwise_loss_and_grad("gspo", lp, inputs, None)

    np.testing.assert_allclose(result.loss, [0.0, 0.0, -1.2, -1.2])  # clipped at 1.2, whole sequence
    np.testing.assert_array_equal(result.dloss_dlp, np.zeros(4))
    assert result.metrics == {"clipped_tokens:sum": 2.0}
    wide = losses.elementwise_loss_and_grad("gspo", lp, inputs, {"clip_high_threshold": 2.0})
    np.testing.assert_allclose(wide.dloss_dlp, [0.0, 0.0, -np.exp(0.5), -np.exp(0.5)])


def _stable_reinforce_reference(lp: np.ndarray, old: np.ndarray, adv: np.ndarray, kl_coeff: float,
                                low: float = 0.5, high: float = 2.0) -> float:
    """The loss at lp with the importance weight held at its value for `old`: what stopgrad means."""
    ratio = np.exp(lp - old)
    weight = np.where((ratio >= low) & (ratio <= high), ratio * adv, 0.0)
    sampled = (adv != 0) | (old != 0)
    return float(-(weight * lp).sum() + kl_coeff * np.where(sampled, ratio - 1 - (lp - old), 0.0).sum())


def test_stable_reinforce_follows_its_formula_and_drops_tokens_outside_the_trust_region() -> None:
    lp = np.array([-3.0, -1.0, -1.0, -0.2, -2.0])
    old = np.array([0.0, -1.1, -0.9, -2.0, -2.5])  # ratios: prompt, 0.90, 1.11, 6.05 (dropped), 1.65
    adv = np.array([0.0, 1.0, -1.0, 1.0, 0.5])
    inputs = {"target_tokens": np.zeros(5, np.int64), "logprobs": old, "advantages": adv}
    config = {"kl_coeff": 0.1}

    loss, grad, metrics = losses.loss_and_grad("stable_reinforce", lp, inputs, config)

    assert loss == pytest.approx(_stable_reinforce_reference(lp, old, adv, 0.1))
    ratio = np.exp(lp - old)

    def held(x: np.ndarray) -> float:  # the weight frozen at lp, the KL term free
        weight = np.where((ratio >= 0.5) & (ratio <= 2.0), ratio * adv, 0.0)
        kl = np.exp(x - old) - 1 - (x - old)
        return float(-(weight * x).sum() + 0.1 * np.where((adv != 0) | (old != 0), kl, 0.0).sum())

    np.testing.assert_allclose(grad, _finite_difference(held, lp), rtol=1e-6, atol=1e-8)
    assert grad[0] == 0.0  # a prompt position is neither trained nor in the KL term
    assert grad[3] == pytest.approx(0.1 * (ratio[3] - 1))  # dropped: only the KL pull remains
    assert metrics == {"clipped_tokens:sum": 1.0}


def test_stable_reinforce_without_kl_is_importance_sampling_inside_the_trust_region() -> None:
    rng = np.random.default_rng(4)
    lp = rng.uniform(-3, -0.1, T)
    inputs = _inputs(rng, lp)  # ratios within e^±0.5, inside [0.5, 2]

    _, grad, metrics = losses.loss_and_grad("stable_reinforce", lp, inputs, {})
    _, is_grad, _ = losses.loss_and_grad("importance_sampling", lp, inputs, {})

    np.testing.assert_allclose(grad, is_grad)
    assert metrics == {"clipped_tokens:sum": 0.0}


def test_every_server_side_loss_the_sdk_names_is_implemented_or_refused_with_a_way_out() -> None:
    from typing import get_args

    from tinker.types import LossFnType

    names = set(get_args(LossFnType))
    assert names - {"custom"} <= set(losses.LOSS_FUNCTIONS)
    with pytest.raises(InvalidRequest, match="not supported") as error:
        losses.validate_loss("custom", [_datum(2, target_tokens=[1, 2])], {"loss_id": "x"})
    assert "forward_backward_custom" in str(error.value.to_dict())


def test_stable_reinforce_and_gspo_validate_their_config() -> None:
    datum = _datum(2, target_tokens=[1, 2], logprobs=[-1.0, -1.0], advantages=[1.0, 0.0])

    with pytest.raises(InvalidRequest, match="kl_coeff must be >= 0"):
        losses.validate_loss("stable_reinforce", [datum], {"kl_coeff": -1.0})
    with pytest.raises(InvalidRequest, match="accepted keys: clip_low_threshold, clip_high_threshold, kl_coeff"):
        losses.validate_loss("stable_reinforce", [datum], {"beta": 0.1})
    with pytest.raises(InvalidRequest, match="sequence_ratio_mask has shape"):
        losses.validate_loss("gspo", [_datum(2, target_tokens=[1, 2], logprobs=[-1.0, -1.0],
                                                advantages=[1.0, 0.0], sequence_ratio_mask=[1.0])], None)
    losses.validate_loss("stable_reinforce", [datum], {"kl_coeff": 0.01, "clip_high_threshold": 3})
