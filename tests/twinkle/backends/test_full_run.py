"""Full-parameter runs on the transformers backend (`hf.full_run`): they learn, resume bit-exactly from their
checkpoints, write plain HuggingFace model directories, leave the LoRA adapters exactly as they were, and
refuse what does not fit them (the other checkpoint kind, a second run, LoRA ops while they hold the replica)."""

from __future__ import annotations

import json
import math
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from twinkle import full_checkpoint
from twinkle.backends import transformers_backend
from twinkle.backends.data_parallel import DataParallelBackend
from twinkle.backends.hf.checkpoint import read_lora_spec
from twinkle.backends.hf.full_run import base_weights
from twinkle.backends.megatron_backend import MegatronBackend
from twinkle.backends.transformers_backend import TransformersBackend
from twinkle.errors import InvalidRequest, PoolReserved
from twinkle.types import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    LoraSpec,
    SampleRequest,
    SamplingParams,
    chunks_from_tokens,
)

BackendFactory = Callable[..., TransformersBackend]
PATTERN = list(range(100, 110)) * 4
FULL = LoraSpec(mode="full", seed=7)
LR = AdamParams(learning_rate=1e-3)


def ce_datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    inputs = {"target_tokens": np.asarray(tokens[1:], np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, np.float32)
    return Datum(chunks_from_tokens(tokens[:-1]), inputs)


def ce_batch(*rows: list[int]) -> ForwardBackwardInput:
    return ForwardBackwardInput([ce_datum(row) for row in rows or (PATTERN,)], "cross_entropy")


def step(backend: TransformersBackend, run_id: str, batch: ForwardBackwardInput | None = None) -> float:
    loss = backend.forward_backward(run_id, batch or ce_batch()).metrics["loss:sum"]
    backend.optim_step(run_id, LR)
    return loss


def weights_of(backend: TransformersBackend) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in base_weights(backend.shared.base.model).items()}


def assert_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def with_attention_dropout(backend: TransformersBackend, p: float = 0.2) -> TransformersBackend:
    """Dropout in every attention layer, so training draws from the run's random stream."""
    for module in backend.shared.base.model.modules():
        if hasattr(module, "attention_dropout"):
            setattr(module, "attention_dropout", p)  # noqa: B010 - typed as a submodule by nn.Module
    return backend


def test_a_full_run_trains_every_base_weight_and_learns_a_fixed_batch(make_backend: BackendFactory) -> None:
    backend = make_backend()
    before = weights_of(backend)
    backend.create_adapter("full", FULL)
    assert backend.has_adapter("full") and backend.resident_adapters() == []  # never in a LoRA slot
    assert backend.fused_solo_reason("full", ce_batch()) is not None
    losses = [step(backend, "full") for _ in range(5)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.95 * losses[0]
    after = weights_of(backend)
    assert all(not torch.equal(before[name], after[name]) for name in before)  # every weight moved
    metrics = backend.optim_step("full", AdamParams(learning_rate=1e-3, grad_clip_norm=1.0))
    assert metrics["grad_norm:mean"] == 0.0 and metrics["learning_rate:mean"] == 1e-3  # nothing accumulated

    backend.remove_adapter("full")
    assert not backend.has_adapter("full")
    assert_equal(weights_of(backend), before)  # bit for bit
    assert not any(param.requires_grad for param in backend.shared.base.model.parameters())


def test_a_full_run_reports_the_grad_norm_before_clipping_as_lora_tenants_do(make_backend: BackendFactory) -> None:
    backend = make_backend()
    backend.create_adapter("full", FULL)
    backend.forward_backward("full", ce_batch())
    assert backend.full is not None
    params = backend.full.tenant.params
    expected = float(torch.nn.utils.get_total_norm([param.grad for param in params if param.grad is not None]))
    metrics = backend.optim_step("full", AdamParams(learning_rate=1e-3, grad_clip_norm=1.0))
    assert metrics["grad_norm:mean"] == pytest.approx(expected, rel=1e-6) and expected > 1.0
    assert all(param.grad is None for param in params)


def test_a_full_run_resumed_from_its_checkpoint_in_a_fresh_backend_continues_bit_exactly(
        make_backend: BackendFactory, tmp_path: Path) -> None:
    first = with_attention_dropout(make_backend())
    first.create_adapter("full", FULL)
    for _ in range(2):
        step(first, "full")
    first.save_state("full", tmp_path, include_optimizer=True)
    in_place = [step(first, "full") for _ in range(3)]

    fresh = with_attention_dropout(make_backend())
    fresh.create_adapter("resumed", LoraSpec(mode="full", seed=99))  # another seed: the checkpoint's stream wins
    fresh.load_state("resumed", tmp_path, include_optimizer=True)
    assert fresh.full is not None and fresh.full.steps == 2
    resumed = [step(fresh, "resumed") for _ in range(3)]

    assert resumed == in_place  # bitwise, dropout masks included
    assert_equal(weights_of(fresh), weights_of(first))
    marker = full_checkpoint.read_marker(tmp_path)
    assert marker["steps"] == 2 and marker["include_optimizer"] is True
    assert marker["base_model"] == first.info.model_name


def test_loading_without_the_optimizer_restarts_its_moments_and_step_count(
        make_backend: BackendFactory, tmp_path: Path) -> None:
    trained = make_backend()
    trained.create_adapter("full", FULL)
    step(trained, "full")
    trained.save_weights_for_sampler("full", tmp_path)
    loaded = make_backend()
    loaded.create_adapter("full", FULL)
    step(loaded, "full")
    step(loaded, "full")
    loaded.load_state("full", tmp_path, include_optimizer=False)
    assert loaded.full is not None and loaded.full.steps == 0
    assert_equal(weights_of(loaded), weights_of(trained))
    with pytest.raises(InvalidRequest, match="no optimizer state"):
        loaded.load_state("full", tmp_path, include_optimizer=True)


def test_a_full_runs_sampler_checkpoint_is_a_plain_sharded_hugging_face_model(
        make_backend: BackendFactory, tmp_path: Path, tiny_model_dir: Path) -> None:
    backend = make_backend(max_shard_size="100KB")
    backend.create_adapter("lora", LoraSpec(rank=4, seed=1))  # its tensors must not leak into the model
    backend.create_adapter("full", FULL)
    step(backend, "full")
    backend.save_weights_for_sampler("full", tmp_path)

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert not any("lora" in key or "base_layer" in key or key.startswith("base_model.") for key in keys)
    assert keys == set(weights_of(backend))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert full_checkpoint.read_marker(tmp_path)["include_optimizer"] is False
    assert not (tmp_path / "optimizer.pt").exists()

    loaded: Any = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PATTERN[:-1]])).logits[0]
    theirs = torch.log_softmax(logits, -1)[torch.arange(len(PATTERN) - 1), torch.tensor(PATTERN[1:])]
    ours = backend.forward("full", ce_batch()).loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-5)


def test_a_lora_adapter_made_before_a_full_run_is_bit_identical_after_it(make_backend: BackendFactory) -> None:
    untouched, visited = make_backend(), make_backend()
    for backend in (untouched, visited):
        backend.create_adapter("lora", LoraSpec(rank=4, seed=1))
        step(backend, "lora")
        backend.forward_backward("lora", ce_batch())  # gradients waiting for the next optim_step
    visited.create_adapter("full", FULL)
    for _ in range(2):
        step(visited, "full")
    visited.forward_backward("full", ce_batch())  # left accumulated: removal drops them
    visited.remove_adapter("full")

    assert_equal(weights_of(visited), weights_of(untouched))
    assert_equal(*(b.shared.state_dict(b.tenants["lora"].name) for b in (visited, untouched)))
    assert [step(visited, "lora") for _ in range(2)] == [step(untouched, "lora") for _ in range(2)]
    np.testing.assert_array_equal(visited.forward("lora", ce_batch()).loss_fn_outputs[0]["logprobs"],
                                  untouched.forward("lora", ce_batch()).loss_fn_outputs[0]["logprobs"])


def test_checkpoint_kinds_are_refused_by_the_other_mode_with_what_to_create(
        make_backend: BackendFactory, tmp_path: Path) -> None:
    lora_dir, full_dir = tmp_path / "lora", tmp_path / "full"
    lora_backend, full_backend = make_backend(), make_backend()
    lora_backend.create_adapter("lora", LoraSpec(rank=4, seed=1))
    lora_backend.save_state("lora", lora_dir, include_optimizer=True)
    full_backend.create_adapter("full", FULL)
    full_backend.save_state("full", full_dir, include_optimizer=True)
    before = weights_of(full_backend)

    with pytest.raises(InvalidRequest, match="full-parameter checkpoint") as raised:
        lora_backend.load_state("lora", full_dir, include_optimizer=True)
    assert "mode='full'" in str(raised.value)
    with pytest.raises(InvalidRequest, match="full-parameter checkpoint"):
        read_lora_spec(full_dir)
    with pytest.raises(InvalidRequest, match="LoRA adapter checkpoint") as raised:
        full_backend.load_state("full", lora_dir, include_optimizer=True)
    assert "mode='lora'" in str(raised.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequest, match="not a full-parameter checkpoint"):
        full_backend.load_state("full", tmp_path / "empty", include_optimizer=False)
    assert_equal(weights_of(full_backend), before)


def test_a_checkpoint_of_another_shape_is_refused_before_any_weight_changes(
        make_backend: BackendFactory, tmp_path: Path) -> None:
    backend = make_backend()
    backend.create_adapter("full", FULL)
    backend.save_weights_for_sampler("full", tmp_path)
    before = weights_of(backend)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidRequest, match="shapes differ"):
        backend.load_state("full", tmp_path, include_optimizer=False)
    assert_equal(weights_of(backend), before)


def test_one_full_run_holds_the_replica_and_lora_ops_wait_for_it(make_backend: BackendFactory) -> None:
    backend = make_backend()
    backend.create_adapter("lora", LoraSpec(rank=4, seed=1))
    backend.create_adapter("full", FULL)
    with pytest.raises(PoolReserved, match="full") as raised:
        backend.create_adapter("second", LoraSpec(mode="full"))
    assert raised.value.details["holder"] == "full" and raised.value.status_code == 423
    for refused in (lambda: backend.create_adapter("other", LoraSpec(rank=4)),
                    lambda: backend.forward_backward("lora", ce_batch()),
                    lambda: backend.run_fused([("lora", ce_batch(), False)])):
        with pytest.raises(PoolReserved):
            refused()
    backend.remove_adapter("full")
    backend.create_adapter("second", LoraSpec(mode="full"))  # free again
    assert backend.has_adapter("second") and not backend.has_adapter("full")


def test_the_megatron_backend_refuses_full_runs_and_points_at_the_docs() -> None:
    backend = MegatronBackend.__new__(MegatronBackend)  # the refusal comes before anything the backend holds
    with pytest.raises(InvalidRequest, match="not available on the megatron backend") as raised:
        backend.create_adapter("full", LoraSpec(mode="full"))
    assert "docs/full_finetune.md" in str(raised.value.hint)


# Reference policy and sampling


def dpo_batch() -> ForwardBackwardInput:
    prompt = PATTERN[:6]
    chosen, rejected = prompt + PATTERN[6:12], [*prompt, 300, 301, 302, 303, 304, 305]
    completion = [0.0] * 5 + [1.0] * 6
    return ForwardBackwardInput([ce_datum(chosen, completion), ce_datum(rejected, completion)], "dpo")


def test_reference_losses_and_disable_lora_read_the_base_model_as_it_was_loaded(
        make_backend: BackendFactory) -> None:
    backend, base = make_backend(), make_backend()
    backend.create_adapter("full", FULL)
    for _ in range(3):
        step(backend, "full")
    trained = weights_of(backend)
    data = dpo_batch().data

    plain = ForwardBackwardInput(data, "cross_entropy")
    policy = [np.asarray(row["logprobs"]) for row in backend.forward("full", plain).loss_fn_outputs]
    base.create_adapter("full-free", LoraSpec(mode="full", seed=1))  # an untrained run: the loaded weights
    reference = [np.asarray(row["logprobs"]) for row in base.forward("full-free", plain).loss_fn_outputs]
    weights = [datum.loss_fn_inputs["weights"] for datum in data]
    chosen, rejected = (0.1 * float((w * (p - r)).sum()) for w, p, r in zip(weights, policy, reference, strict=True))
    expected = math.log1p(math.exp(-(chosen - rejected)))

    dpo = backend.forward("full", dpo_batch())
    assert dpo.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    assert abs(expected - math.log(2)) > 1e-3  # the run moved away from its reference
    no_lora = ForwardBackwardInput(data, "cross_entropy", disable_lora=True)
    for ours, theirs in zip(backend.forward("full", no_lora).loss_fn_outputs, reference, strict=True):
        np.testing.assert_array_equal(np.asarray(ours["logprobs"]), theirs)
    backend.forward_backward("full", dpo_batch())  # the trained weights take the gradient, not the reference
    assert backend.full is not None and all(param.grad is not None for param in backend.full.tenant.params)
    assert_equal(weights_of(backend), trained)


def test_a_full_run_samples_its_trained_weights_and_the_base_model_stays_servable(
        make_backend: BackendFactory) -> None:
    backend, base = make_backend(), make_backend()
    backend.create_adapter("full", FULL)
    for _ in range(8):
        step(backend, "full")
    request = [SampleRequest(chunks_from_tokens(PATTERN[:5]), SamplingParams(max_tokens=6, temperature=0.0),
                             prompt_logprobs=True)]
    trained = backend.sample("full", request)[0]
    assert trained.sequences[0].tokens == PATTERN[5:11]  # the pattern, learnt
    prompt_lp = backend.forward("full", ce_batch(PATTERN[:5])).loss_fn_outputs[0]["logprobs"]
    assert trained.prompt_logprobs is not None
    np.testing.assert_allclose(np.asarray(trained.prompt_logprobs[1:], np.float32), np.asarray(prompt_lp), atol=1e-5)
    assert backend.sample(None, request)[0].sequences[0].tokens == base.sample(None, request)[0].sequences[0].tokens


# Data parallelism


class ThreadSumReducer:
    """GradientReducer for ranks that are threads of one process; every rank sums in rank order."""

    def __init__(self, rank: int, slots: list[Any], barrier: threading.Barrier) -> None:
        self.rank, self.slots, self.barrier = rank, slots, barrier
        self.calls = 0

    def sum_(self, buffers: Sequence[Any]) -> None:
        self.calls += 1
        self.slots[self.rank] = [torch.as_tensor(buffer).clone() for buffer in buffers]
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        for index, buffer in enumerate(buffers):
            total = sum(theirs[index] for theirs in everyone)
            if isinstance(buffer, np.ndarray):
                buffer[...] = total.numpy()
            else:
                buffer.copy_(total)


def test_two_data_parallel_ranks_sum_a_full_runs_gradients_like_one_replica(
        make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.twinkle.backends.test_data_parallel import ThreadRanks

    monkeypatch.setattr(transformers_backend, "GRADIENT_BUCKET_BYTES", 64 * 1024)  # several all-reduces
    ranks = ThreadRanks(2, make_backend)
    slots: list[Any] = [None, None]
    barrier = threading.Barrier(2)
    reducers = [ThreadSumReducer(rank, slots, barrier) for rank in range(2)]
    for replica, reducer in zip(ranks.replicas, reducers, strict=True):
        replica.reducer = reducer
    parallel = DataParallelBackend(ranks, dp_size=2, info=ranks.replicas[0].backend.info, spmd=False)
    single = make_backend()
    data = ce_batch(PATTERN, PATTERN[3:30])
    for backend in (parallel, single):
        backend.create_adapter("full", FULL)
    for _ in range(2):
        ours, theirs = parallel.forward_backward("full", data), single.forward_backward("full", data)
        assert ours.metrics["loss:sum"] == pytest.approx(theirs.metrics["loss:sum"], rel=1e-5)
        norm_ours, norm_theirs = parallel.optim_step("full", LR), single.optim_step("full", LR)
        assert norm_ours["grad_norm:mean"] == pytest.approx(norm_theirs["grad_norm:mean"], rel=1e-5)
    assert reducers[0].calls > 2  # the gradients went in buckets
    rank0, rank1 = (weights_of(replica.backend) for replica in ranks.replicas)
    assert_equal(rank0, rank1)  # the ranks never drift apart
    for name, value in weights_of(single).items():
        torch.testing.assert_close(rank0[name], value, rtol=1e-4, atol=1e-6)


# A model whose weights transformers renames on load (fused MoE experts)


def test_a_model_with_converted_weight_names_saves_and_resumes_through_its_own_loader(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-moe"
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            num_experts=4, num_experts_per_tok=2)
    Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_model_dir / name, model_dir / name)

    def make() -> TransformersBackend:
        return TransformersBackend(str(model_dir), torch_dtype="float32", device="cpu")

    first = make()
    first.create_adapter("full", FULL)
    step(first, "full")
    first.save_state("full", tmp_path / "checkpoint", include_optimizer=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "checkpoint" / "model.safetensors"), framework="pt") as handle:
        saved = set(handle.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in saved  # the hub's layout, not the fused one
    assert not set(weights_of(first)) <= saved
    in_place = [step(first, "full") for _ in range(2)]

    fresh = make()
    fresh.create_adapter("full", FULL)
    fresh.load_state("full", tmp_path / "checkpoint", include_optimizer=True)
    assert [step(fresh, "full") for _ in range(2)] == in_place
    assert_equal(weights_of(fresh), weights_of(first))
