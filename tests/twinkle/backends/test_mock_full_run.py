"""Full-parameter runs on the mock backend: training every weight of the bigram model, checkpoints that are
mock model directories, and the mock sampler serving them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinkle.backends.mock import FULL_OPTIMIZER_FILE, MockBackend
from twinkle.backends.mock_model import (
    BASE_FILE,
    BaseGrads,
    BigramBase,
    accumulate_base_gradients,
    target_logprobs,
)
from twinkle.backends.paging import PagingBudget
from twinkle.errors import InvalidRequest, PoolReserved
from twinkle.full_checkpoint import is_full_checkpoint, read_marker
from twinkle.samplers.mock import MockSampler
from twinkle.types import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    LoraSpec,
    SampleRequest,
    SamplingParams,
    chunks_from_tokens,
)

VOCAB = 64
CYCLE = [3, 17, 42, 8, 29]
ADAM = AdamParams(learning_rate=0.05)
FULL = LoraSpec(mode="full", seed=7)
_Indices = list[tuple[int, ...]]


def _cycle_batch(length: int = 30) -> ForwardBackwardInput:
    sequence = np.array((CYCLE * length)[: length + 1])
    return ForwardBackwardInput([Datum(chunks_from_tokens(sequence[:-1]), {"target_tokens": sequence[1:]})] * 2)


def _random_batch(seed: int, datums: int = 4, length: int = 16, vocab: int = VOCAB) -> ForwardBackwardInput:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(datums):
        tokens = rng.integers(0, vocab, length + 1)
        weights = rng.uniform(0, 1, length).astype(np.float32)
        data.append(Datum(chunks_from_tokens(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights}))
    return ForwardBackwardInput(data)


def _train(backend: MockBackend, run_id: str, steps: int, batch: ForwardBackwardInput,
           params: AdamParams = ADAM) -> list[float]:
    history = []
    for _ in range(steps):
        history.append(backend.forward_backward(run_id, batch).metrics["loss:sum"])
        backend.optim_step(run_id, params)
    return history


def _saved(backend: MockBackend, run_id: str, directory: Path, *, include_optimizer: bool = True) -> Path:
    directory.mkdir()
    backend.save_state(run_id, directory, include_optimizer=include_optimizer)
    return directory


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as stored:
        return {key: stored[key] for key in stored.files}


def _logprobs(backend: MockBackend, run_id: str, batch: ForwardBackwardInput) -> np.ndarray:
    return np.concatenate([out["logprobs"] for out in backend.forward(run_id, batch).loss_fn_outputs])


class _RecordingReducer:
    """The all-reduce of a one-rank group (the sum is the buffers themselves); keeps copies of what it saw."""

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []

    def sum_(self, buffers: Sequence[Any]) -> None:
        self.seen = [np.array(buffer, copy=True) for buffer in buffers]


class _AddOtherRank:
    """The all-reduce of a two-rank group, seen from one rank whose peer's buffers are already known."""

    def __init__(self, other: list[np.ndarray]) -> None:
        self.other = other

    def sum_(self, buffers: Sequence[Any]) -> None:
        for buffer, theirs in zip(buffers, self.other, strict=True):
            buffer += theirs


def test_full_run_gradients_match_finite_differences() -> None:
    # float64 copies of the model so central differences are accurate; V=50 leaves a padded last class.
    base32 = BigramBase.build(50, dim=6)
    base = BigramBase(50, base32.class_size, base32.num_classes,
                      *(array.astype(np.float64) for array in base32.parameters()))
    rng = np.random.default_rng(0)
    prev, target = rng.integers(0, 50, 40), np.r_[rng.integers(0, 50, 38), 49, 48]
    mask = (rng.random((40, 6)) > 0.3) / 0.7
    coefficient = rng.normal(size=40)

    def loss() -> float:
        return float(coefficient @ target_logprobs(base, None, prev, target, mask).logprobs)

    grads = BaseGrads.zeros_like(base)
    accumulate_base_gradients(base, target_logprobs(base, None, prev, target, mask), coefficient, grads)

    real_rows = base.num_classes + 50  # rows past it belong to the padding ids
    unseen = int(np.setdiff1d(np.arange(50), prev)[0])  # never a `prev`: its embedding gets no gradient
    embedding_indices: _Indices = [(int(token), column) for token in [*prev[:8], unseen] for column in range(6)]
    unembedding_indices: _Indices = [(int(row), int(column)) for row, column in
                                     rng.integers((0, 0), (real_rows, 6), (40, 2))]
    probes: list[tuple[np.ndarray, np.ndarray, _Indices]] = [
        (base.embeddings, grads.embeddings, embedding_indices),
        (base.unembedding, grads.unembedding, unembedding_indices),
        (base.bias, grads.bias, [(int(row),) for row in rng.integers(0, real_rows, 20)]),
    ]
    for weights, grad, indices in probes:
        for index in indices:
            saved = weights[index]
            weights[index] = saved + 1e-6
            above = loss()
            weights[index] = saved - 1e-6
            below = loss()
            weights[index] = saved
            assert grad[index] == pytest.approx((above - below) / 2e-6, rel=1e-5, abs=1e-8), index
    assert not grads.embeddings[unseen].any()
    assert not grads.bias[real_rows:].any() and not grads.unembedding[real_rows:].any()


def test_a_full_run_lowers_the_loss_and_reports_the_adapters_metrics() -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("lora", LoraSpec(rank=8, seed=1))
    backend.forward_backward("lora", _cycle_batch())
    lora_metrics = backend.optim_step("lora", ADAM)
    backend.create_adapter("full", FULL)

    history = _train(backend, "full", 15, _cycle_batch())
    backend.forward_backward("full", _cycle_batch())
    full_metrics = backend.optim_step("full", ADAM)

    assert history[-1] < 0.3 * history[0]
    assert full_metrics.keys() == lora_metrics.keys()
    assert full_metrics["grad_norm:mean"] > 0 and full_metrics["learning_rate:mean"] == ADAM.learning_rate
    assert backend.optim_step("full", ADAM)["grad_norm:mean"] == 0.0  # nothing accumulated since
    assert backend.has_adapter("full") and backend.full_run == "full" and backend.resident_adapters() == ["lora"]


def test_a_full_run_trains_every_weight_like_torch_adamw_with_clipping(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    backend = MockBackend(VOCAB)
    backend.create_adapter("full", FULL)
    params = AdamParams(learning_rate=0.02, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=2.0)
    base = BigramBase.build(VOCAB)
    reference = [torch.nn.Parameter(torch.from_numpy(array.copy())) for array in base.parameters()]
    optimizer = torch.optim.AdamW(reference, lr=params.learning_rate, betas=(params.beta1, params.beta2),
                                  eps=params.eps, weight_decay=params.weight_decay)
    other = np.array([48, 50, 53, 55, 48, 49])  # other rows of E and W than the cycle: momentum on rows without grad
    other_batch = ForwardBackwardInput([Datum(chunks_from_tokens(other[:-1]), {"target_tokens": other[1:]})])

    for batch in (_cycle_batch(), other_batch, _cycle_batch()):
        backend.forward_backward("full", batch)
        norm = backend.optim_step("full", params)["grad_norm:mean"]

        current = BigramBase(VOCAB, base.class_size, base.num_classes,
                             *(parameter.detach().numpy().copy() for parameter in reference))
        prev = np.concatenate([datum.tokens() for datum in batch.data])
        target = np.concatenate([datum.loss_fn_inputs["target_tokens"] for datum in batch.data])
        grads = BaseGrads.zeros_like(current)
        forward = target_logprobs(current, None, prev, target)
        accumulate_base_gradients(current, forward, -np.ones_like(forward.logprobs), grads)
        for parameter, grad in zip(reference, grads.arrays(), strict=True):
            parameter.grad = torch.from_numpy(grad)
        expected_norm = torch.nn.utils.clip_grad_norm_(reference, params.grad_clip_norm)
        optimizer.step()
        assert norm == pytest.approx(float(expected_norm), rel=1e-5)
        assert norm > params.grad_clip_norm  # the clip really cut

    weights = _arrays(_saved(backend, "full", tmp_path / "final") / BASE_FILE)
    for name, parameter in zip(("embeddings", "unembedding", "bias"), reference, strict=True):
        expected = parameter.detach().numpy()
        real = slice(None) if name != "bias" else slice(0, base.num_classes + VOCAB)  # padding stays masked
        np.testing.assert_allclose(weights[name][real], expected[real], rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.array_equal(weights[name], getattr(base, name)), f"{name} was not trained"
    assert np.array_equal(weights["bias"][base.num_classes + VOCAB :], base.bias[base.num_classes + VOCAB :])


def test_weight_decay_never_unmasks_the_padding_ids(tmp_path: Path) -> None:
    vocab = 60  # classes of 8 ids: the last class has 4 padding ids
    backend = MockBackend(vocab)
    backend.create_adapter("full", FULL)
    padding = slice(-4, None)
    masked = BigramBase.build(vocab).bias[padding].copy()

    _train(backend, "full", 3, _random_batch(0, length=8, vocab=vocab), AdamParams(learning_rate=0.1, weight_decay=0.5))

    weights = _arrays(_saved(backend, "full", tmp_path / "decayed") / BASE_FILE)
    assert np.array_equal(weights["bias"][padding], masked)
    decayed = BigramBase.build(vocab).unembedding[padding] * (1 - 0.1 * 0.5) ** 3  # no gradient: decay alone
    np.testing.assert_allclose(weights["unembedding"][padding], decayed, rtol=1e-6)


def test_resuming_a_full_run_in_a_fresh_backend_is_bitwise_exact(tmp_path: Path) -> None:
    spec = LoraSpec(mode="full", seed=5, dropout=0.2)  # dropout makes the result depend on the saved RNG
    batch = _random_batch(11)
    original = MockBackend(VOCAB)
    original.create_adapter("full", spec)
    _train(original, "full", 3, batch)
    checkpoint = _saved(original, "full", tmp_path / "step3")
    expected = _train(original, "full", 3, batch)
    expected_state = _saved(original, "full", tmp_path / "original-step6")

    resumed = MockBackend(VOCAB)
    resumed.create_adapter("other-id", spec)
    _train(resumed, "other-id", 1, _cycle_batch())  # whatever it did before is replaced
    resumed.load_state("other-id", checkpoint, include_optimizer=True)

    assert _train(resumed, "other-id", 3, batch) == expected
    resumed_state = _saved(resumed, "other-id", tmp_path / "resumed-step6")
    for name in (BASE_FILE, FULL_OPTIMIZER_FILE):
        ours, theirs = _arrays(resumed_state / name), _arrays(expected_state / name)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert np.array_equal(ours[key], theirs[key]), (name, key)
    assert read_marker(resumed_state)["steps"] == 6


def test_loading_a_full_checkpoint_without_the_optimizer_restarts_it(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("full", FULL)
    _train(backend, "full", 3, _cycle_batch())
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    backend.save_weights_for_sampler("full", weights_only)

    fresh = MockBackend(VOCAB)
    fresh.create_adapter("full", FULL)
    fresh.load_state("full", weights_only, include_optimizer=False)

    assert np.array_equal(_logprobs(fresh, "full", _cycle_batch()), _logprobs(backend, "full", _cycle_batch()))
    assert not (weights_only / FULL_OPTIMIZER_FILE).exists()
    assert read_marker(_saved(fresh, "full", tmp_path / "fresh"))["steps"] == 0
    with pytest.raises(InvalidRequest, match="without optimizer state"):
        fresh.load_state("full", weights_only, include_optimizer=True)


def test_lora_ops_wait_out_a_full_run_and_find_their_adapters_and_the_base_bitwise_unchanged(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("lora", LoraSpec(rank=8, seed=1))
    _train(backend, "lora", 3, _random_batch(1))
    backend.forward_backward("lora", _random_batch(2))  # a pending gradient, too
    before = _arrays(_saved(backend, "lora", tmp_path / "before") / "adapter.npz")
    lora_logprobs = _logprobs(backend, "lora", _cycle_batch())
    base_request = SampleRequest(chunks_from_tokens([3]), SamplingParams(max_tokens=8, seed=0), num_samples=4)
    base_samples = backend.sample(None, [base_request])

    backend.create_adapter("full", LoraSpec(mode="full", seed=2, dropout=0.1))
    _train(backend, "full", 5, _cycle_batch())
    backend.forward_backward("full", _random_batch(3))
    lora_ops = [
        lambda: backend.forward("lora", _cycle_batch()),
        lambda: backend.forward_backward("lora", _cycle_batch()),
        lambda: backend.optim_step("lora", ADAM),
        lambda: backend.save_state("lora", tmp_path, include_optimizer=True),
        lambda: backend.sample("lora", [base_request]),
        lambda: backend.create_adapter("new", LoraSpec(rank=4)),
    ]
    for op in lora_ops:
        with pytest.raises(PoolReserved, match="Full-parameter run full holds this backend") as refused:
            op()
        assert refused.value.details == {"holder": "full"}
    assert backend.sample(None, [base_request]) == base_samples  # the base model is served as it was
    assert backend.has_adapter("lora") and not backend.has_adapter("new")
    backend.remove_adapter("full")

    assert not backend.has_adapter("full") and backend.full_run is None
    after = _arrays(_saved(backend, "lora", tmp_path / "after") / "adapter.npz")
    for key in before:
        assert np.array_equal(before[key], after[key]), key
    assert np.array_equal(_logprobs(backend, "lora", _cycle_batch()), lora_logprobs)
    assert backend.sample(None, [base_request]) == base_samples
    assert backend.optim_step("lora", ADAM)["grad_norm:mean"] > 0  # the pending gradient survived
    backend.create_adapter("next", FULL)  # starts from the base as it is now: bitwise the original
    restored = _arrays(_saved(backend, "next", tmp_path / "next") / BASE_FILE)
    for name, original in zip(("embeddings", "unembedding", "bias"), BigramBase.build(VOCAB).parameters(), strict=True):
        assert np.array_equal(restored[name], original), name


def test_a_forward_with_disable_lora_on_a_full_run_scores_with_the_original_base() -> None:
    untouched = MockBackend(VOCAB)
    untouched.create_adapter("lora", LoraSpec(rank=4, seed=0))  # a fresh adapter is exactly the base
    backend = MockBackend(VOCAB)
    backend.create_adapter("full", FULL)
    _train(backend, "full", 5, _cycle_batch())
    batch = _cycle_batch()
    reference = ForwardBackwardInput(batch.data, disable_lora=True)

    assert np.array_equal(_logprobs(backend, "full", reference), _logprobs(untouched, "lora", batch))
    assert not np.array_equal(_logprobs(backend, "full", batch), _logprobs(untouched, "lora", batch))


def test_checkpoints_of_the_wrong_kind_are_refused_both_ways(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("lora", LoraSpec(rank=8, seed=1))
    _train(backend, "lora", 2, _cycle_batch())
    lora_checkpoint = _saved(backend, "lora", tmp_path / "lora")
    lora_logprobs = _logprobs(backend, "lora", _cycle_batch())
    backend.create_adapter("full", FULL)
    _train(backend, "full", 2, _cycle_batch())
    full_checkpoint = _saved(backend, "full", tmp_path / "full")
    full_logprobs = _logprobs(backend, "full", _cycle_batch())

    with pytest.raises(InvalidRequest, match="lora is a LoRA adapter checkpoint, and this model is a full-parameter "
                                             r"run\. Create a LoRA model \(mode='lora'\)"):
        backend.load_state("full", lora_checkpoint, include_optimizer=True)
    with pytest.raises(InvalidRequest, match=r"is not a full-parameter checkpoint: twinkle_full\.json is missing"):
        backend.load_state("full", tmp_path, include_optimizer=False)
    assert np.array_equal(_logprobs(backend, "full", _cycle_batch()), full_logprobs)  # nothing changed
    backend.remove_adapter("full")
    with pytest.raises(InvalidRequest, match=r"full is a full-parameter checkpoint \(a whole model, written by a "
                                             r"full run\), not a LoRA adapter\. Create a full-parameter model "
                                             r"\(mode='full'\)"):
        backend.load_state("lora", full_checkpoint, include_optimizer=False)

    assert np.array_equal(_logprobs(backend, "lora", _cycle_batch()), lora_logprobs)
    assert is_full_checkpoint(full_checkpoint) and not is_full_checkpoint(lora_checkpoint)


def test_a_second_full_run_is_refused_naming_the_holder() -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("first", FULL)

    with pytest.raises(PoolReserved, match="Full-parameter run first already holds this backend") as refused:
        backend.create_adapter("second", FULL)
    with pytest.raises(InvalidRequest, match="already exists"):
        backend.create_adapter("first", LoraSpec(rank=4))
    with pytest.raises(InvalidRequest, match="Unknown training mode 'partial'"):
        backend.create_adapter("third", LoraSpec(mode="partial"))
    assert refused.value.details == {"holder": "first"} and not backend.has_adapter("second")
    backend.remove_adapter("first")
    backend.create_adapter("second", FULL)
    assert backend.full_run == "second"


def test_a_full_run_takes_no_lora_slot_and_is_never_paged(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB, max_loras=1, paging=PagingBudget(host_bytes=1 << 30, disk_bytes=0))
    for name in ("a", "b"):  # one slot: b pages a out
        backend.create_adapter(name, LoraSpec(rank=4, seed=1))
        _train(backend, name, 1, _random_batch(0))
    expected_b = _logprobs(backend, "b", _cycle_batch())

    backend.create_adapter("full", FULL)
    history = _train(backend, "full", 3, _cycle_batch())
    assert backend.paging_stats()["page_outs"] == 1 and backend.resident_adapters() == ["b"]
    backend.remove_adapter("full")

    straight = MockBackend(VOCAB)
    straight.create_adapter("full", FULL)
    assert history == _train(straight, "full", 3, _cycle_batch())
    assert np.array_equal(_logprobs(backend, "b", _cycle_batch()), expected_b)
    assert backend.has_adapter("a") and backend.paging_stats()["page_outs"] == 1


@pytest.mark.parametrize("split", [2, 4], ids=["even-shards", "an-empty-shard"])
def test_sync_gradients_sums_a_full_runs_gradients_over_the_ranks(split: int) -> None:
    data = _random_batch(4).data
    ranks = [MockBackend(VOCAB), MockBackend(VOCAB)]
    single = MockBackend(VOCAB)
    for backend in (*ranks, single):
        backend.create_adapter("full", FULL)
    for rank, shard in zip(ranks, (data[:split], data[split:]), strict=True):
        if shard:
            rank.forward_backward("full", ForwardBackwardInput(shard))
    single.forward_backward("full", ForwardBackwardInput(data))

    recorders = [_RecordingReducer(), _RecordingReducer()]
    for rank, recorder in zip(ranks, recorders, strict=True):
        rank.sync_gradients("full", recorder)
    ranks[0].sync_gradients("full", _AddOtherRank(recorders[1].seen))
    ranks[1].sync_gradients("full", _AddOtherRank(recorders[0].seen))
    norms = [backend.optim_step("full", ADAM)["grad_norm:mean"] for backend in (*ranks, single)]

    assert norms[0] == norms[1] == pytest.approx(norms[2], rel=1e-5)
    assert np.array_equal(_logprobs(ranks[0], "full", _cycle_batch()), _logprobs(ranks[1], "full", _cycle_batch()))
    np.testing.assert_allclose(_logprobs(ranks[0], "full", _cycle_batch()), _logprobs(single, "full", _cycle_batch()),
                               rtol=1e-5)


def test_a_full_checkpoint_is_a_mock_model_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": 8}))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    backend = MockBackend(model_dir)
    backend.create_adapter("full", FULL)
    _train(backend, "full", 5, _cycle_batch())
    checkpoint = tmp_path / "sampler-weights"
    checkpoint.mkdir()
    backend.save_weights_for_sampler("full", checkpoint)

    served = MockBackend(checkpoint)
    served.create_adapter("lora", LoraSpec(rank=4, seed=0))  # a fresh adapter: exactly the served base

    assert read_marker(checkpoint) == {"format": 1, "base_model": "tiny-model", "steps": 5, "include_optimizer": False}
    for name in ("config.json", "tokenizer_config.json"):
        assert (checkpoint / name).read_bytes() == (model_dir / name).read_bytes()
    assert served.info.vocab_size == VOCAB and served.info.eos_token_id == 8
    assert np.array_equal(_logprobs(served, "lora", _cycle_batch()), _logprobs(backend, "full", _cycle_batch()))


def test_the_mock_sampler_serves_a_full_checkpoint_with_its_weights(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("full", FULL)
    _train(backend, "full", 20, _cycle_batch())
    checkpoint = tmp_path / "weights"
    checkpoint.mkdir()
    backend.save_weights_for_sampler("full", checkpoint)
    sampler = MockSampler(VOCAB)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    prompt = chunks_from_tokens(CYCLE)

    trained, base = sampler.sample([
        SampleRequest(prompt, greedy, adapter_path=str(checkpoint), prompt_logprobs=True, topk_sample_logprobs=3),
        SampleRequest(prompt, greedy, prompt_logprobs=True, topk_sample_logprobs=3),
    ])

    assert trained.sequences[0].tokens == (CYCLE * 3)[:10]
    assert base.sequences[0].tokens != (CYCLE * 3)[:10]
    trained_lp, base_lp = trained.prompt_logprobs, base.prompt_logprobs
    assert trained_lp is not None and base_lp is not None
    # Each step of the cycle went from an unlikely next token to a nearly certain one; the base stayed as it was.
    assert all(logprob > np.log(0.5) for logprob in trained_lp[1:])
    assert all(logprob < np.log(0.2) for logprob in base_lp[1:])
    scored = ForwardBackwardInput([Datum(chunks_from_tokens(CYCLE[:-1]), {"target_tokens": np.array(CYCLE[1:])})])
    assert trained_lp[1:] == _logprobs(backend, "full", scored).tolist()
    assert base_lp[1:] == _logprobs(backend, "full", ForwardBackwardInput(scored.data, disable_lora=True)).tolist()
    in_memory = backend.sample("full", [SampleRequest(prompt, greedy, topk_sample_logprobs=3)])[0]
    assert in_memory.sequences == trained.sequences


def test_the_mock_sampler_reloads_a_full_checkpoint_rewritten_in_place(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("full", FULL)
    checkpoint = tmp_path / "weights"
    checkpoint.mkdir()
    backend.save_weights_for_sampler("full", checkpoint)
    sampler = MockSampler(VOCAB, max_cached_adapters=1)
    request = SampleRequest(chunks_from_tokens(CYCLE), SamplingParams(max_tokens=0), adapter_path=str(checkpoint),
                            prompt_logprobs=True)
    untrained = sampler.sample([request])[0].prompt_logprobs

    _train(backend, "full", 10, _cycle_batch())
    backend.save_weights_for_sampler("full", checkpoint)
    retrained = sampler.sample([request])[0].prompt_logprobs

    assert untrained == MockSampler(VOCAB).sample([SampleRequest(request.prompt, request.params,
                                                                 prompt_logprobs=True)])[0].prompt_logprobs
    assert retrained != untrained and retrained == MockSampler(VOCAB).sample([request])[0].prompt_logprobs


def test_a_mock_sampler_built_on_a_full_checkpoint_serves_its_weights_as_the_base(tmp_path: Path) -> None:
    backend = MockBackend(VOCAB)
    backend.create_adapter("full", FULL)
    _train(backend, "full", 20, _cycle_batch())
    checkpoint = _saved(backend, "full", tmp_path / "state")

    output = MockSampler(checkpoint).sample([SampleRequest(chunks_from_tokens([3]),
                                                           SamplingParams(max_tokens=5, temperature=0.0))])[0]

    assert output.sequences[0].tokens == [17, 42, 8, 29, 3]
