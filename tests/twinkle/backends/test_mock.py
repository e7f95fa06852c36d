from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from twinkle.backends.base import ModelBackend
from twinkle.backends.mock import MockBackend
from twinkle.backends.mock_model import (
    BigramBase,
    LoraGrads,
    LoraWeights,
    accumulate_gradients,
    target_logprobs,
)
from twinkle.backends.paging import PagingBudget
from twinkle.errors import InvalidRequest, LimitExceeded, NotFound
from twinkle.types import AdamParams, Datum, ForwardBackwardInput, ImageChunk, LoraSpec, chunks_from_tokens

REPO_ROOT = Path(__file__).resolve().parents[3]
VOCAB = 64
CYCLE = [3, 17, 42, 8, 29]
ADAM = AdamParams(learning_rate=0.05)


def _cycle_batch(length: int = 30, copies: int = 2) -> ForwardBackwardInput:
    sequence = np.array((CYCLE * length)[: length + 1])
    datum = Datum(chunks_from_tokens(sequence[:-1]), {"target_tokens": sequence[1:]})
    return ForwardBackwardInput([datum] * copies)


def _random_batch(seed: int, datums: int = 4, length: int = 16, vocab: int = VOCAB) -> ForwardBackwardInput:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(datums):
        tokens = rng.integers(0, vocab, length + 1)
        weights = rng.uniform(0, 1, length).astype(np.float32)
        data.append(Datum(chunks_from_tokens(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights}))
    return ForwardBackwardInput(data)


def _backend(**kwargs: int) -> MockBackend:
    backend = MockBackend(VOCAB, **kwargs)
    backend.create_adapter("a", LoraSpec(rank=8, seed=1))
    return backend


def _state(backend: MockBackend, adapter_id: str, directory: Path) -> dict[str, np.ndarray]:
    directory.mkdir()
    backend.save_state(adapter_id, directory, include_optimizer=True)
    with np.load(directory / "adapter.npz") as stored:
        return {key: stored[key] for key in stored.files}


def _train(backend: MockBackend, adapter_id: str, steps: int, batch: ForwardBackwardInput) -> list[float]:
    history = []
    for _ in range(steps):
        history.append(backend.forward_backward(adapter_id, batch).metrics["loss:sum"])
        backend.optim_step(adapter_id, ADAM)
    return history


def test_importing_the_mock_modules_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import twinkle.losses, twinkle.backends.mock, twinkle.backends.mock_model, twinkle.samplers.mock\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, env={"PYTHONPATH": str(REPO_ROOT)}
    )


def test_model_gradients_match_finite_differences() -> None:
    # float64 copies of the model, so central differences are accurate; V=50 leaves a padded last class.
    base32 = BigramBase.build(50, dim=6)
    base = BigramBase(
        50,
        base32.class_size,
        base32.num_classes,
        *(a.astype(np.float64) for a in (base32.embeddings, base32.unembedding, base32.bias)),
    )
    rng = np.random.default_rng(0)
    lora = LoraWeights(rng.normal(size=(6, 3)), rng.normal(size=(base.columns, 3)) * 0.3, scale=2.0)
    prev, target = rng.integers(0, 50, 40), np.r_[rng.integers(0, 50, 38), 49, 48]
    mask = (rng.random((40, 6)) > 0.3) / 0.7
    coefficient = rng.normal(size=40)

    def loss() -> float:
        return float(coefficient @ target_logprobs(base, lora, prev, target, mask).logprobs)

    grads = LoraGrads(np.zeros_like(lora.down), np.zeros_like(lora.up))
    accumulate_gradients(base, lora, target_logprobs(base, lora, prev, target, mask), coefficient, grads)

    real_rows = base.num_classes + 50  # rows past it belong to the padding ids
    up_indices = list(zip(rng.integers(0, real_rows, 40), rng.integers(0, 3, 40), strict=True))
    probes = [(lora.down, grads.down, list(np.ndindex(lora.down.shape))), (lora.up, grads.up, up_indices)]
    for weights, grad, indices in probes:
        for index in indices:
            saved = weights[index]
            weights[index] = saved + 1e-6
            above = loss()
            weights[index] = saved - 1e-6
            below = loss()
            weights[index] = saved
            assert grad[index] == pytest.approx((above - below) / 2e-6, rel=1e-5, abs=1e-8)
    assert not grads.up[real_rows:].any()


def test_mock_backend_fulfils_the_model_backend_protocol() -> None:
    backend: ModelBackend = _backend()
    assert backend.has_adapter("a")


def test_info_is_read_from_the_model_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": [7, 9]}))

    info = MockBackend(str(model_dir), max_length=128).info

    assert (info.model_name, info.vocab_size, info.eos_token_id) == ("tiny-qwen", 300, 7)
    assert info.tokenizer_id == str(model_dir.absolute())
    assert info.max_context_length == 128


def test_info_for_a_bare_vocabulary_size() -> None:
    info = MockBackend(VOCAB).info

    assert (info.model_name, info.vocab_size, info.max_context_length) == ("mock", VOCAB, 32768)
    assert info.tokenizer_id is None and info.eos_token_id is None


def test_forward_logprobs_are_a_normalised_distribution_over_the_vocabulary() -> None:
    backend = _backend()
    _train(backend, "a", 3, _random_batch(0))
    every_next_token = Datum(chunks_from_tokens([5] * VOCAB), {"target_tokens": np.arange(VOCAB)})

    output = backend.forward("a", ForwardBackwardInput([every_next_token]))

    logprobs = output.loss_fn_outputs[0]["logprobs"]
    assert logprobs.dtype == np.float32 and logprobs.shape == (VOCAB,)
    assert np.all(logprobs < 0)
    assert np.logaddexp.reduce(logprobs.astype(np.float64)) == pytest.approx(0.0, abs=1e-5)


def test_forward_reports_per_token_outputs_and_one_colon_metrics() -> None:
    backend = _backend()
    batch = _random_batch(0)

    output = backend.forward("a", batch)

    assert len(output.loss_fn_outputs) == 4
    for datum, result in zip(batch.data, output.loss_fn_outputs, strict=True):
        weights = datum.loss_fn_inputs["weights"]
        np.testing.assert_allclose(result["elementwise_loss"], -weights * result["logprobs"], rtol=1e-6)
    total = sum(float(result["elementwise_loss"].sum()) for result in output.loss_fn_outputs)
    assert output.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert all(key.count(":") == 1 for key in output.metrics)


def test_fresh_adapters_equal_the_base_model_whatever_their_seed() -> None:
    backend = _backend()
    backend.create_adapter("b", LoraSpec(rank=4, seed=99))
    batch = _random_batch(3)

    first = backend.forward("a", batch).loss_fn_outputs
    second = backend.forward("b", batch).loss_fn_outputs

    for a, b in zip(first, second, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-6)


def test_forward_with_disable_lora_gives_the_base_models_logprobs_after_training() -> None:
    backend = _backend()
    backend.create_adapter("fresh", LoraSpec(rank=4))
    batch = _cycle_batch()
    _train(backend, "a", 5, batch)
    base_only = replace(batch, disable_lora=True)

    trained = backend.forward("a", batch).loss_fn_outputs[0]["logprobs"]
    without = backend.forward("a", base_only).loss_fn_outputs[0]["logprobs"]
    base = backend.forward("fresh", batch).loss_fn_outputs[0]["logprobs"]

    np.testing.assert_allclose(without, base, rtol=1e-6)
    assert not np.allclose(trained, base)


def test_optim_step_lowers_the_loss_on_repeated_data() -> None:
    backend = _backend()

    history = _train(backend, "a", 20, _cycle_batch())

    assert history[-1] < 0.2 * history[0]
    assert all(later < earlier for earlier, later in itertools.pairwise(history[:6]))


def test_forward_neither_accumulates_gradients_nor_changes_weights(tmp_path: Path) -> None:
    backend = _backend()
    before = _state(backend, "a", tmp_path / "before")

    backend.forward("a", _cycle_batch())
    metrics = backend.optim_step("a", ADAM)

    assert metrics["grad_norm:mean"] == 0.0
    after = _state(backend, "a", tmp_path / "after")
    assert all(np.array_equal(before[key], after[key]) for key in before)


def test_two_half_batches_accumulate_to_the_gradient_of_the_full_batch(tmp_path: Path) -> None:
    full = _random_batch(7, datums=6)
    whole, halves = _backend(), _backend()
    _train(whole, "a", 2, _cycle_batch())
    _train(halves, "a", 2, _cycle_batch())

    whole.forward_backward("a", full)
    halves.forward_backward("a", ForwardBackwardInput(full.data[:3]))
    halves.forward_backward("a", ForwardBackwardInput(full.data[3:]))
    whole_metrics, halves_metrics = whole.optim_step("a", ADAM), halves.optim_step("a", ADAM)

    assert halves_metrics["grad_norm:mean"] == pytest.approx(whole_metrics["grad_norm:mean"], rel=1e-5)
    whole_state = _state(whole, "a", tmp_path / "whole")
    halves_state = _state(halves, "a", tmp_path / "halves")
    for key in ("exp_avg_down", "exp_avg_up", "down", "up"):
        np.testing.assert_allclose(halves_state[key], whole_state[key], rtol=1e-4, atol=1e-6)


def test_grad_norm_is_reported_before_clipping_and_the_update_uses_the_clipped_gradient(
    tmp_path: Path,
) -> None:
    clipped, free = _backend(), _backend()
    clip = AdamParams(learning_rate=0.05, grad_clip_norm=0.5)

    clipped.forward_backward("a", _cycle_batch())
    free.forward_backward("a", _cycle_batch())
    clipped_norm = clipped.optim_step("a", clip)["grad_norm:mean"]
    free_norm = free.optim_step("a", ADAM)["grad_norm:mean"]

    assert clipped_norm == free_norm > 10 * clip.grad_clip_norm
    state = _state(clipped, "a", tmp_path / "clipped")
    # After one step exp_avg = (1 - beta1) · gradient, so its norm shows the gradient was clipped.
    moment_norm = np.sqrt(
        sum(np.sum(state[k].astype(np.float64) ** 2) for k in ("exp_avg_down", "exp_avg_up"))
    )
    assert moment_norm == pytest.approx((1 - clip.beta1) * clip.grad_clip_norm, rel=1e-4)


def test_optim_step_reports_the_learning_rate() -> None:
    backend = _backend()
    backend.forward_backward("a", _cycle_batch())

    assert backend.optim_step("a", AdamParams(learning_rate=0.003))["learning_rate:mean"] == 0.003


def test_weight_decay_is_decoupled_from_the_gradient(tmp_path: Path) -> None:
    backend = _backend()
    before = _state(backend, "a", tmp_path / "before")
    params = AdamParams(learning_rate=0.1, weight_decay=0.5)

    backend.forward_backward("a", _cycle_batch())
    backend.optim_step("a", params)

    # B starts at zero, so A's first gradient is zero and only the decay moves it.
    after = _state(backend, "a", tmp_path / "after")
    np.testing.assert_allclose(after["down"], before["down"] * (1 - 0.1 * 0.5), rtol=1e-6)
    assert np.abs(after["up"]).max() > 0


def test_optimizer_matches_torch_adamw_with_gradient_clipping(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    backend = _backend()
    params = AdamParams(learning_rate=0.02, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=2.0)
    start = _state(backend, "a", tmp_path / "start")
    down, up = (torch.nn.Parameter(torch.from_numpy(start[key].copy())) for key in ("down", "up"))
    reference = torch.optim.AdamW(
        [down, up],
        lr=params.learning_rate,
        betas=(params.beta1, params.beta2),
        eps=params.eps,
        weight_decay=params.weight_decay,
    )
    base = BigramBase.build(VOCAB)  # the same base model every mock backend builds
    # Token classes have 8 ids: the cycle touches classes {0, 1, 2, 3, 5}, the other batch only {6}, so
    # some steps carry momentum on rows without gradient, and classes 4 and 7 must stay exactly zero.
    other = np.array([48, 50, 53, 55, 48, 49])
    other_batch = ForwardBackwardInput([Datum(chunks_from_tokens(other[:-1]), {"target_tokens": other[1:]})])

    for batch in (_cycle_batch(), other_batch, other_batch, _cycle_batch()):
        backend.forward_backward("a", batch)
        norm = backend.optim_step("a", params)["grad_norm:mean"]

        prev = np.concatenate([datum.tokens() for datum in batch.data])
        target = np.concatenate([datum.loss_fn_inputs["target_tokens"] for datum in batch.data])
        lora = LoraWeights(down.detach().numpy().copy(), up.detach().numpy().copy(), float(start["scale"]))
        grads = LoraGrads(np.zeros_like(lora.down), np.zeros_like(lora.up))
        forward = target_logprobs(base, lora, prev, target)
        accumulate_gradients(base, lora, forward, -np.ones_like(forward.logprobs), grads)
        down.grad, up.grad = torch.from_numpy(grads.down), torch.from_numpy(grads.up)
        expected_norm = torch.nn.utils.clip_grad_norm_([down, up], params.grad_clip_norm)
        reference.step()
        assert norm == pytest.approx(float(expected_norm), rel=1e-5)

    final = _state(backend, "a", tmp_path / "final")
    np.testing.assert_allclose(final["down"], down.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final["up"], up.detach().numpy(), rtol=1e-5, atol=1e-6)
    state = reference.state[up]
    np.testing.assert_allclose(final["exp_avg_sq_up"], state["exp_avg_sq"].numpy(), rtol=1e-4, atol=1e-12)
    assert int(final["step"]) == 4
    blocks = final["up"][base.num_classes :].reshape(base.num_classes, base.class_size, -1)
    assert not blocks[[4, 7]].any() and blocks[[0, 1, 2, 3, 5, 6]].any(axis=(1, 2)).all()


def test_training_one_adapter_never_changes_another_bit_for_bit(tmp_path: Path) -> None:
    backend = _backend()
    backend.create_adapter("b", LoraSpec(rank=8, seed=1, dropout=0.1))
    _train(backend, "b", 2, _random_batch(1))
    backend.forward_backward("b", _random_batch(2))  # b also has gradients waiting
    before = _state(backend, "b", tmp_path / "before")
    forward_before = backend.forward("b", _cycle_batch()).loss_fn_outputs[0]["logprobs"]

    _train(backend, "a", 5, _cycle_batch())
    backend.forward_backward("a", _random_batch(3))

    after = _state(backend, "b", tmp_path / "after")
    assert before.keys() == after.keys()
    for key in before:
        assert np.array_equal(before[key], after[key]), key
    assert np.array_equal(backend.forward("b", _cycle_batch()).loss_fn_outputs[0]["logprobs"], forward_before)
    metrics = backend.optim_step("b", ADAM)
    assert metrics["grad_norm:mean"] > 0  # b's pending gradient survived a's steps


def test_max_loras_is_a_hard_wall_with_the_numbers_when_paging_is_off() -> None:
    backend = MockBackend(VOCAB, max_loras=2, paging=PagingBudget(host_bytes=0, disk_bytes=0))
    backend.create_adapter("a", LoraSpec(rank=8, seed=1))
    backend.create_adapter("b", LoraSpec(rank=4))

    with pytest.raises(LimitExceeded, match=r"All 2 LoRA slots .*paging is off"):
        backend.create_adapter("c", LoraSpec(rank=4))
    backend.remove_adapter("b")
    backend.create_adapter("c", LoraSpec(rank=4))
    assert backend.has_adapter("c") and not backend.has_adapter("b")


def test_max_length_is_enforced_with_the_numbers() -> None:
    backend = _backend(max_length=16)
    too_long = _random_batch(0, length=20).data[0]

    with pytest.raises(InvalidRequest, match="datum 1 has 20 tokens, over this model's limit of 16"):
        backend.forward_backward("a", ForwardBackwardInput([_random_batch(0).data[0], too_long]))


def test_bad_inputs_are_rejected_before_anything_changes() -> None:
    backend = _backend()
    outside = Datum(chunks_from_tokens([1, VOCAB]), {"target_tokens": np.array([2, 3])})
    image = Datum(
        [*chunks_from_tokens([1]), ImageChunk(b"png", expected_tokens=1)], {"target_tokens": np.array([2, 3])}
    )

    with pytest.raises(InvalidRequest, match=r"token ids outside \[0, 64\)"):
        backend.forward_backward("a", ForwardBackwardInput([outside]))
    with pytest.raises(InvalidRequest, match="text only"):
        backend.forward("a", ForwardBackwardInput([image]))
    with pytest.raises(InvalidRequest, match="Unknown loss_fn"):
        backend.forward("a", ForwardBackwardInput(_cycle_batch().data, loss_fn="mse"))
    with pytest.raises(NotFound):
        backend.forward("missing", _cycle_batch())
    with pytest.raises(InvalidRequest, match="already exists"):
        backend.create_adapter("a", LoraSpec())
    with pytest.raises(InvalidRequest, match="beta1"):
        backend.optim_step("a", AdamParams(beta1=1.5))
    assert backend.optim_step("a", ADAM)["grad_norm:mean"] == 0.0


def test_top_k_target_tokens_score_every_candidate() -> None:
    backend = _backend()
    tokens = np.array([1, 2, 3])
    candidates = np.array([[2, 5], [3, 6], [4, 7]])
    top_k = Datum(chunks_from_tokens(tokens), {"target_tokens": candidates})
    first = Datum(chunks_from_tokens(tokens), {"target_tokens": candidates[:, 0]})
    second = Datum(chunks_from_tokens(tokens), {"target_tokens": candidates[:, 1]})

    output = backend.forward("a", ForwardBackwardInput([top_k, first, second])).loss_fn_outputs

    assert output[0]["logprobs"].shape == (3, 2)
    np.testing.assert_allclose(output[0]["logprobs"][:, 0], output[1]["logprobs"], rtol=1e-6)
    np.testing.assert_allclose(output[0]["logprobs"][:, 1], output[2]["logprobs"], rtol=1e-6)


def test_rl_losses_raise_the_logprob_of_advantaged_tokens() -> None:
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        backend = _backend()
        datum = _cycle_batch().data[0]
        old = backend.forward("a", _cycle_batch()).loss_fn_outputs[0]["logprobs"]
        inputs = {**datum.loss_fn_inputs, "logprobs": old, "advantages": np.ones_like(old)}
        batch = ForwardBackwardInput([Datum(datum.model_input, inputs)], loss_fn=loss_fn)

        for _ in range(3):
            backend.forward_backward("a", batch)
            backend.optim_step("a", AdamParams(learning_rate=0.01))

        new = backend.forward("a", batch).loss_fn_outputs[0]["logprobs"]
        assert new.mean() > old.mean(), loss_fn


def test_resuming_from_saved_state_is_bitwise_exact(tmp_path: Path) -> None:
    spec = LoraSpec(rank=8, seed=5, dropout=0.2)  # dropout makes the result depend on the saved RNG
    batch = _random_batch(11)
    original = MockBackend(VOCAB)
    original.create_adapter("a", spec)
    _train(original, "a", 3, batch)
    original.save_state("a", tmp_path, include_optimizer=True)
    expected = _train(original, "a", 3, batch)

    resumed = MockBackend(VOCAB)
    resumed.create_adapter("other-id", spec)
    resumed.load_state("other-id", tmp_path, include_optimizer=True)

    assert _train(resumed, "other-id", 3, batch) == expected


def test_loading_without_the_optimizer_restarts_it(tmp_path: Path) -> None:
    backend = _backend()
    _train(backend, "a", 3, _cycle_batch())
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    backend.save_weights_for_sampler("a", weights_only)
    trained = backend.forward("a", _cycle_batch()).metrics["loss:sum"]

    fresh = _backend()
    fresh.load_state("a", weights_only, include_optimizer=False)

    assert fresh.forward("a", _cycle_batch()).metrics["loss:sum"] == trained
    assert _state(fresh, "a", tmp_path / "fresh")["step"] == 0
    with pytest.raises(InvalidRequest, match="without optimizer state"):
        fresh.load_state("a", weights_only, include_optimizer=True)


def test_loading_a_checkpoint_of_another_rank_or_vocabulary_is_refused(tmp_path: Path) -> None:
    _backend().save_state("a", tmp_path, include_optimizer=True)
    other_rank = MockBackend(VOCAB)
    other_rank.create_adapter("a", LoraSpec(rank=4))
    other_vocab = MockBackend(VOCAB + 1)
    other_vocab.create_adapter("a", LoraSpec(rank=8))

    with pytest.raises(InvalidRequest, match=r"rank 8 .* rank 4"):
        other_rank.load_state("a", tmp_path, include_optimizer=True)
    with pytest.raises(InvalidRequest, match="vocabulary of 64 tokens, but this model has 65"):
        other_vocab.load_state("a", tmp_path, include_optimizer=True)
    with pytest.raises(NotFound):
        other_rank.load_state("a", tmp_path / "missing", include_optimizer=False)


def test_adapter_seed_decides_the_initialisation() -> None:
    backend = MockBackend(VOCAB)
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        backend.create_adapter(name, LoraSpec(rank=4, seed=seed))
        _train(backend, name, 2, _cycle_batch())

    losses = {name: backend.forward(name, _cycle_batch()).metrics["loss:sum"] for name in "abc"}

    assert losses["a"] == losses["b"] != losses["c"]


def test_a_qwen_sized_vocabulary_trains_without_a_vocab_by_vocab_matrix() -> None:
    vocab = 151_936
    backend = MockBackend(vocab)
    backend.create_adapter("a", LoraSpec(rank=4, seed=0))
    batch = _random_batch(0, datums=2, length=32, vocab=vocab)

    before = np.concatenate([out["logprobs"] for out in backend.forward("a", batch).loss_fn_outputs])
    history = _train(backend, "a", 5, batch)

    # The base model is close to uniform over 151,936 tokens on random text.
    assert np.log(vocab) < -before.mean() < np.log(vocab) + 3
    assert history[-1] < history[0]
