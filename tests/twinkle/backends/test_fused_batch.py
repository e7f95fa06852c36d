"""Fused multi-tenant passes give every adapter what it would get alone (transformers backend, tiny model).

Two backends are built identically (same adapters, same seeds): one runs each call alone, the other runs
them all as one fused pass with per-row LoRA routing. Per adapter, losses, metrics, logprobs, gradients and
the weights after an optimizer step must agree.

Tolerance: float32 with rtol 1e-4 / atol 1e-6 (gradients: atol 1e-5). The two runs compute the same sums
in a different order only: the fused pass pads rows to the longest call's length and runs the LoRA
matmuls batched over rows of several ranks (zero padding adds exact zeros), so float32 results differ by
a few ulps of the summed magnitudes (measured: under 1e-6 relative); a wrong routing, a gradient reaching
the wrong adapter or a loss mixed across calls changes them by orders of magnitude more.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from twinkle.backends.hf import fused_lora
from twinkle.backends.transformers_backend import TransformersBackend
from twinkle.errors import InvalidRequest
from twinkle.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec, chunks_from_tokens

BackendFactory = Callable[..., TransformersBackend]
RTOL, ATOL, GRAD_ATOL = 1e-4, 1e-6, 1e-5

SPECS = {
    "attn-r4": LoraSpec(rank=4, seed=1, target_modules=("q_proj", "v_proj")),
    "all-r8": LoraSpec(rank=8, seed=2, train_unembed=False),
    "mlp-head-r2": LoraSpec(rank=2, seed=3, train_attn=False),
    "dpo-r4": LoraSpec(rank=4, seed=4, train_mlp=False, train_unembed=False),
    "reader-r16": LoraSpec(rank=16, seed=5),
}


def datum(tokens: list[int], **inputs: list[float]) -> Datum:
    arrays: dict[str, np.ndarray] = {"target_tokens": np.asarray(tokens[1:], np.int64)}
    arrays.update({key: np.asarray(values, np.float32) for key, values in inputs.items()})
    return Datum(chunks_from_tokens(tokens[:-1]), arrays)


def tokens(start: int, length: int) -> list[int]:
    return [(start + 7 * i) % 200 + 20 for i in range(length + 1)]


def calls() -> list[tuple[str, ForwardBackwardInput, bool]]:
    rng = np.random.default_rng(0)

    def rl(start: int, length: int) -> Datum:
        return datum(tokens(start, length), logprobs=list(-rng.random(length) - 1),
                     advantages=list(rng.normal(size=length)))

    return [
        ("attn-r4", ForwardBackwardInput([datum(tokens(1, 12)), datum(tokens(2, 5), weights=[0, 1, 1, 1, 0.5])],
                                         "cross_entropy"), True),
        ("all-r8", ForwardBackwardInput([rl(3, 9), rl(4, 17)], "importance_sampling"), True),
        ("mlp-head-r2", ForwardBackwardInput([rl(5, 8)], "ppo", {"clip_low_threshold": 0.9}), True),
        ("dpo-r4", ForwardBackwardInput([datum(tokens(6, 7)), datum(tokens(7, 10))], "dpo"), True),
        ("reader-r16", ForwardBackwardInput([datum(tokens(8, 6))], "cross_entropy"), False),
        ("attn-r4", ForwardBackwardInput([datum(tokens(9, 4))], "cross_entropy"), True),  # accumulates
    ]


def build(make_backend: BackendFactory) -> TransformersBackend:
    backend = make_backend()
    generator = torch.Generator().manual_seed(0)
    for adapter_id, spec in SPECS.items():
        backend.create_adapter(adapter_id, spec)
        with torch.no_grad():  # PEFT starts B at zero; make every adapter change the model, and differently
            for param in backend.tenants[adapter_id].params:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return backend


def grads(backend: TransformersBackend, adapter_id: str) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in backend.tenants[adapter_id].params]


def close(a: object, b: object, atol: float = ATOL) -> None:
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=RTOL, atol=atol)


def test_a_fused_pass_gives_each_adapter_its_solo_outputs_metrics_and_gradients(make_backend: BackendFactory) -> None:
    solo, fused = build(make_backend), build(make_backend)
    work = calls()
    expected = [(solo.forward_backward if backward else solo.forward)(adapter_id, batch)
                for adapter_id, batch, backward in work]
    got = fused.run_fused(work)
    for want, out in zip(expected, got, strict=True):
        assert not isinstance(out, Exception), out
        assert set(out.metrics) == set(want.metrics)
        for key in want.metrics:
            close(out.metrics[key], want.metrics[key])
        for row_want, row_out in zip(want.loss_fn_outputs, out.loss_fn_outputs, strict=True):
            close(row_out["logprobs"], row_want["logprobs"])
            close(row_out["elementwise_loss"], row_want["elementwise_loss"])
    for adapter_id in SPECS:
        for g_solo, g_fused in zip(grads(solo, adapter_id), grads(fused, adapter_id), strict=True):
            assert (g_solo is None) == (g_fused is None), adapter_id
            if g_solo is not None and g_fused is not None:
                assert float(g_solo.abs().max()) > 0
                close(g_fused, g_solo, GRAD_ATOL)
    assert all(g is None for g in grads(fused, "reader-r16"))  # a forward leaves AdamW's "no grad" alone
    for backend in (solo, fused):
        for adapter_id in ("attn-r4", "all-r8", "mlp-head-r2", "dpo-r4"):
            backend.optim_step(adapter_id, AdamParams(learning_rate=1e-2))
    for adapter_id in SPECS:
        for p_solo, p_fused in zip(solo.tenants[adapter_id].params, fused.tenants[adapter_id].params, strict=True):
            close(p_fused.detach(), p_solo.detach(), GRAD_ATOL)


def test_a_bad_call_fails_alone_and_the_others_still_train(make_backend: BackendFactory) -> None:
    solo, fused = build(make_backend), build(make_backend)
    good = ForwardBackwardInput([datum(tokens(1, 10))], "cross_entropy")
    bad = ForwardBackwardInput([datum([1, 2, 10**6])], "cross_entropy")  # a token outside the vocabulary
    want = solo.forward_backward("all-r8", good)
    failed, out = fused.run_fused([("attn-r4", bad, True), ("all-r8", good, True)])
    assert isinstance(failed, InvalidRequest)
    assert not isinstance(out, Exception)
    close(out.metrics["loss:sum"], want.metrics["loss:sum"])
    assert all(g is None for g in grads(fused, "attn-r4"))


def test_the_active_adapter_keeps_training_solo_after_a_fused_pass(make_backend: BackendFactory) -> None:
    solo, fused = build(make_backend), build(make_backend)
    batch = ForwardBackwardInput([datum(tokens(3, 9))], "cross_entropy")
    fused.run_fused([("all-r8", batch, False)])  # leaves requires_grad flags as they were
    for backend in (solo, fused):
        backend.forward_backward("reader-r16", batch)
    for g_solo, g_fused in zip(grads(solo, "reader-r16"), grads(fused, "reader-r16"), strict=True):
        assert g_solo is not None and g_fused is not None
        close(g_fused, g_solo, GRAD_ATOL)


def test_calls_that_cannot_be_fused_exactly_are_named(make_backend: BackendFactory) -> None:
    backend = make_backend()
    backend.create_adapter("dropout", LoraSpec(rank=4, seed=1, dropout=0.1))
    backend.create_adapter("plain", LoraSpec(rank=4, seed=1))
    batch = ForwardBackwardInput([datum(tokens(1, 4))])
    assert "dropout" in (backend.fused_solo_reason("dropout", batch) or "")
    assert backend.fused_solo_reason("plain", batch) is None
    base_only = ForwardBackwardInput([datum(tokens(1, 4))], disable_lora=True)
    assert backend.fused_solo_reason("plain", base_only) is not None


def test_per_row_routing_matches_peft_mixed_batches_for_interleaved_rows(make_backend: BackendFactory) -> None:
    backend = build(make_backend)
    shared = backend.shared
    names = [backend.tenants[a].name for a in ("all-r8", "attn-r4", "all-r8", "mlp-head-r2")] + [fused_lora.BASE_ROW]
    ids = torch.tensor([tokens(i, 6)[:6] for i in range(len(names))])
    shared.train(False)
    with torch.no_grad():
        assert shared.peft is not None
        want = shared.peft(adapter_names=names, input_ids=ids).logits  # PEFT's own mixed batch: per group
        with fused_lora.routed(shared.peft, names):
            got = shared(adapter_names=None, input_ids=ids).logits
        assert torch.equal(shared(names, input_ids=ids).logits, got)  # what samplers run: routed per row
    close(got, want, GRAD_ATOL)  # logits: sums over the hidden size of weights 0.2 in size
    assert not (got[0] - got[1]).abs().max() < 1e-6  # rows really took different adapters


@pytest.mark.parametrize("rows", [1, 3])
def test_routing_leaves_the_layers_as_they_were(make_backend: BackendFactory, rows: int) -> None:
    backend = build(make_backend)
    assert backend.shared.peft is not None
    with fused_lora.routed(backend.shared.peft, [backend.tenants["all-r8"].name] * rows):
        pass
    assert all("forward" not in vars(layer) for layer in fused_lora.lora_layers(backend.shared.peft))


def test_a_data_parallel_pool_fuses_each_ranks_shards_and_merges_every_call_as_alone(
        make_backend: BackendFactory) -> None:
    from tests.twinkle.backends.test_data_parallel import ThreadRanks
    from twinkle.backends.data_parallel import DataParallelBackend

    ranks = ThreadRanks(2, lambda: build(make_backend))
    parallel = DataParallelBackend(ranks, dp_size=2, info=ranks.replicas[0].backend.info, spmd=False)
    parallel._adapters.update(SPECS)  # created on every rank by `build`, with the same seeds and weights
    solo = build(make_backend)
    work = [call for call in calls() if call[1].loss_fn != "dpo"]  # (dpo pairs shard as pairs; same path)
    assert all(parallel.fused_solo_reason(adapter_id, batch) is None for adapter_id, batch, _ in work)
    expected = [(solo.forward_backward if backward else solo.forward)(adapter_id, batch)
                for adapter_id, batch, backward in work]
    for want, out in zip(expected, parallel.run_fused(work), strict=True):
        assert not isinstance(out, Exception), out
        close(out.metrics["loss:sum"], want.metrics["loss:sum"])
        for row_want, row_out in zip(want.loss_fn_outputs, out.loss_fn_outputs, strict=True):
            close(row_out["logprobs"], row_want["logprobs"])
    summed = [sum(g for g in grads_pair if g is not None) for grads_pair in
              zip(*(grads(replica.backend, "all-r8") for replica in ranks.replicas), strict=True)]
    for g_solo, g_ranks in zip(grads(solo, "all-r8"), summed, strict=True):
        assert g_solo is not None
        close(g_ranks, g_solo, GRAD_ATOL)  # what optim_step's all-reduce will apply
