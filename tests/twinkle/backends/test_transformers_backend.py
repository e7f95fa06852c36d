from __future__ import annotations

import gc
import json
import math
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from twinkle.backends.hf import loading
from twinkle.backends.hf.checkpoint import read_lora_spec
from twinkle.backends.paging import PagingBudget
from twinkle.backends.transformers_backend import TransformersBackend
from twinkle.errors import InvalidRequest, LimitExceeded, NotFound
from twinkle.types import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ImageChunk,
    LoraSpec,
    SampleRequest,
    SamplingParams,
    chunks_from_tokens,
)

BackendFactory = Callable[..., TransformersBackend]
TEST_DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")
# Ten tokens repeated: quick for a LoRA to learn, so greedy sampling shows what training did.
PATTERN = list(range(100, 110)) * 4
ON_CPU = TEST_DEVICE == "cpu"


def ce_datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    """Next-token cross entropy over `tokens`: inputs tokens[:-1], targets tokens[1:]."""
    inputs = {"target_tokens": np.asarray(tokens[1:], np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, np.float32)
    return Datum(chunks_from_tokens(tokens[:-1]), inputs)


def ce_batch(*data: Datum) -> ForwardBackwardInput:
    return ForwardBackwardInput(list(data), "cross_entropy")


def train(backend: TransformersBackend, adapter_id: str, steps: int, lr: float = 3e-3) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(backend.forward_backward(adapter_id, ce_batch(ce_datum(PATTERN))).metrics["loss:sum"])
        backend.optim_step(adapter_id, AdamParams(learning_rate=lr))
    return losses


def adapter_tensors(backend: TransformersBackend, adapter_id: str) -> dict[str, torch.Tensor]:
    return {
        key: value.detach().clone()
        for key, value in backend.shared.state_dict(backend.tenants[adapter_id].name).items()
    }


def optimizer_tensors(backend: TransformersBackend, adapter_id: str) -> list[torch.Tensor]:
    state = backend.tenants[adapter_id].optimizer.state_dict()["state"]
    return [value.clone() for slot in state.values() for value in slot.values()]


def assert_same(
    left: dict[str, torch.Tensor] | list[torch.Tensor], right: dict[str, torch.Tensor] | list[torch.Tensor]
) -> None:
    pairs = zip(left.values(), right.values(), strict=True) if isinstance(left, dict) else zip(left, right, strict=True)  # type: ignore[union-attr, arg-type]
    for a, b in pairs:
        assert torch.equal(a, b)


# Loading


def test_model_ids_resolve_to_local_directories_and_hub_snapshots(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id: asked.append(repo_id) or tiny_model_dir)

    assert loading.model_directory(str(tiny_model_dir)) == tiny_model_dir
    assert loading.model_directory("hf://Qwen/Qwen3-0.6B") == tiny_model_dir
    assert loading.model_directory("Qwen/Qwen3-0.6B") == tiny_model_dir
    assert asked == ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"]
    with pytest.raises(InvalidRequest, match="neither a local directory nor a hub id"):
        loading.model_directory("not-a-model")


def test_modelscope_ids_need_the_modelscope_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "modelscope", None)  # import fails as if it were not installed
    with pytest.raises(InvalidRequest) as raised:
        loading.model_directory("ms://Qwen/Qwen3-0.6B")
    assert raised.value.hint == "pip install modelscope"


def test_remote_code_runs_only_when_the_operator_opts_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(loading.TRUST_REMOTE_CODE_ENV, raising=False)
    assert loading.trust_remote_code(None) is False
    monkeypatch.setenv(loading.TRUST_REMOTE_CODE_ENV, "1")
    assert loading.trust_remote_code(None) is True
    assert loading.trust_remote_code(False) is False


def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_accelerators() -> None:
    assert loading.pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert loading.pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(InvalidRequest, match="torch_dtype"):
        loading.pick_dtype("int8", torch.device("cpu"))


def test_model_info_describes_the_base_model(backend: TransformersBackend, tiny_model_dir: Path) -> None:
    assert backend.info.vocab_size == 512
    assert backend.info.max_context_length == 2048
    assert backend.info.arch == "Qwen3ForCausalLM"
    assert backend.info.eos_token_id == backend.shared.base.tokenizer.eos_token_id
    assert all(not param.requires_grad for param in backend.shared.base.model.parameters())


# Forward and losses


def test_forward_reports_float32_logprobs_per_datum_and_the_summed_loss(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=0))
    data = [ce_datum(PATTERN[:12]), ce_datum(PATTERN[:7], weights=[0, 0, 1, 1, 1, 1])]

    output = backend.forward("a", ce_batch(*data))

    assert [out["logprobs"].shape for out in output.loss_fn_outputs] == [(11,), (6,)]
    assert all(out["logprobs"].dtype == np.float32 for out in output.loss_fn_outputs)
    assert all((out["logprobs"] < 0).all() for out in output.loss_fn_outputs)
    expected = -output.loss_fn_outputs[0]["logprobs"].sum() - output.loss_fn_outputs[1]["logprobs"][2:].sum()
    assert output.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5)
    summed = sum(float(out["elementwise_loss"].sum()) for out in output.loss_fn_outputs)
    assert summed == pytest.approx(output.metrics["loss:sum"], rel=1e-5)
    assert all(key.count(":") == 1 for key in output.metrics)


def test_right_padding_does_not_change_a_datums_logprobs(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=0))
    short, long = ce_datum(PATTERN[:5]), ce_datum(PATTERN[3:30])

    alone = backend.forward("a", ce_batch(short)).loss_fn_outputs[0]["logprobs"]
    padded = backend.forward("a", ce_batch(long, short)).loss_fn_outputs[1]["logprobs"]

    np.testing.assert_allclose(padded, alone, atol=1e-5)


def test_top_k_targets_give_logprobs_of_their_shape(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=0))
    tokens = PATTERN[:6]
    targets = np.stack([tokens[1:], [7] * 5], axis=1)
    datum = Datum(chunks_from_tokens(tokens[:-1]), {"target_tokens": targets, "weights": np.ones((5, 2), np.float32)})

    output = backend.forward("a", ce_batch(datum))

    first_column = backend.forward("a", ce_batch(ce_datum(tokens))).loss_fn_outputs[0]["logprobs"]
    assert output.loss_fn_outputs[0]["logprobs"].shape == (5, 2)
    np.testing.assert_allclose(output.loss_fn_outputs[0]["logprobs"][:, 0], first_column, atol=1e-6)


def test_unknown_loss_is_rejected_with_the_supported_names(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4))
    with pytest.raises(InvalidRequest) as raised:
        backend.forward_backward("a", ForwardBackwardInput([ce_datum(PATTERN[:5])], "sft"))
    assert "cross_entropy" in str(raised.value) and "dpo" in str(raised.value)


def test_overlong_datums_are_rejected_with_the_numbers(make_backend: BackendFactory) -> None:
    backend = make_backend(max_length=16)
    backend.create_adapter("a", LoraSpec(rank=4))
    with pytest.raises(InvalidRequest, match="20 tokens, over the max_length of 16"):
        backend.forward_backward("a", ce_batch(ce_datum(PATTERN[:21])))


def test_images_and_out_of_vocabulary_tokens_are_rejected(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4))
    image = Datum([*chunks_from_tokens([1, 2]), ImageChunk(b"png")], {"target_tokens": np.array([2, 3])})
    with pytest.raises(InvalidRequest, match="text only"):
        backend.forward("a", ce_batch(image))
    with pytest.raises(InvalidRequest, match="outside"):
        backend.forward("a", ce_batch(ce_datum([1, 2, 99999])))


def test_ops_on_an_unknown_adapter_raise_not_found(backend: TransformersBackend) -> None:
    with pytest.raises(NotFound):
        backend.forward("nobody", ce_batch(ce_datum(PATTERN[:5])))


# Training


def test_optim_step_lowers_the_loss_on_repeated_data(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=8, seed=1))
    losses = train(backend, "a", steps=8)
    assert losses[-1] < 0.7 * losses[0]


def test_optim_step_without_gradients_reports_zero_norm(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=0))
    before = adapter_tensors(backend, "a")

    metrics = backend.optim_step("a", AdamParams(learning_rate=1e-2))

    assert metrics == {"grad_norm:mean": 0.0, "learning_rate:mean": 1e-2}
    assert_same(adapter_tensors(backend, "a"), before)


def test_grad_norm_is_measured_before_clipping_and_the_update_is_clipped(make_backend: BackendFactory) -> None:
    # With a huge eps Adam's first update is lr·grad/eps, so the step shows the gradient it applied.
    norms, updates = [], []
    for clip in (0.0, 1e-3):
        backend = make_backend()
        backend.create_adapter("a", LoraSpec(rank=4, seed=7))
        before = adapter_tensors(backend, "a")
        backend.forward_backward("a", ce_batch(ce_datum(PATTERN)))
        metrics = backend.optim_step("a", AdamParams(learning_rate=1.0, eps=1e6, grad_clip_norm=clip))
        after = adapter_tensors(backend, "a")
        norms.append(metrics["grad_norm:mean"])
        updates.append(math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in before)))
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 1e-3
    assert updates[1] / updates[0] == pytest.approx(1e-3 / norms[0], rel=1e-3)


def test_learning_rate_is_taken_from_each_step(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=0))
    before = adapter_tensors(backend, "a")
    backend.forward_backward("a", ce_batch(ce_datum(PATTERN)))
    assert backend.optim_step("a", AdamParams(learning_rate=0.0))["learning_rate:mean"] == 0.0
    assert_same(adapter_tensors(backend, "a"), before)
    backend.forward_backward("a", ce_batch(ce_datum(PATTERN)))
    backend.optim_step("a", AdamParams(learning_rate=1e-3))
    assert any(
        not torch.equal(a, b) for a, b in zip(adapter_tensors(backend, "a").values(), before.values(), strict=True)
    )


def test_invalid_adam_params_are_rejected(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4))
    with pytest.raises(InvalidRequest, match="beta2"):
        backend.optim_step("a", AdamParams(beta2=1.5))


# Tenancy


def test_only_the_active_adapter_requires_grad(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4))
    backend.create_adapter("b", LoraSpec(rank=4))
    backend.forward_backward("a", ce_batch(ce_datum(PATTERN[:8])))

    trainable = {name for name, param in backend.shared.peft.named_parameters() if param.requires_grad}  # type: ignore[union-attr]
    with_grad = {name for name, param in backend.shared.peft.named_parameters() if param.grad is not None}  # type: ignore[union-attr]

    name_a = backend.tenants["a"].name
    assert trainable and all(f".{name_a}." in name for name in trainable)
    assert with_grad == trainable


def test_forward_with_disable_lora_gives_the_base_models_logprobs_after_training(
    backend: TransformersBackend,
) -> None:
    backend.create_adapter("trained", LoraSpec(rank=4, seed=1))
    backend.create_adapter("fresh", LoraSpec(rank=4, seed=2))  # LoRA starts as a no-op: the base model
    train(backend, "trained", steps=3)
    batch = ce_batch(ce_datum(PATTERN[:12]))

    trained = backend.forward("trained", batch).loss_fn_outputs[0]["logprobs"]
    without = backend.forward("trained", replace(batch, disable_lora=True)).loss_fn_outputs[0]["logprobs"]
    base = backend.forward("fresh", batch).loss_fn_outputs[0]["logprobs"]

    np.testing.assert_allclose(without, base, atol=1e-6)
    assert not np.allclose(trained, base, atol=1e-3)
    again = backend.forward("trained", batch).loss_fn_outputs[0]["logprobs"]
    np.testing.assert_array_equal(again, trained)  # the adapter is back on afterwards


def test_training_one_adapter_leaves_another_bit_identical(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=1))
    backend.create_adapter("b", LoraSpec(rank=4, seed=2))
    train(backend, "b", steps=1)  # so b has optimizer moments to compare
    weights_b, moments_b = adapter_tensors(backend, "b"), optimizer_tensors(backend, "b")

    train(backend, "a", steps=3)

    assert_same(adapter_tensors(backend, "b"), weights_b)
    assert_same(optimizer_tensors(backend, "b"), moments_b)
    assert backend.tenants["b"].steps == 1 and backend.tenants["a"].steps == 3


def test_interleaved_tenants_match_sequential_runs(make_backend: BackendFactory) -> None:
    # Dropout makes each tenant draw random numbers: their streams must not mix either.
    specs = {"a": LoraSpec(rank=4, seed=1, dropout=0.1), "b": LoraSpec(rank=8, seed=2, dropout=0.1)}
    data = {"a": ce_batch(ce_datum(PATTERN[:20])), "b": ce_batch(ce_datum(PATTERN[5:30]), ce_datum(PATTERN[:9]))}
    sequential, interleaved = make_backend(), make_backend()
    for backend in (sequential, interleaved):
        for adapter_id, spec in specs.items():
            backend.create_adapter(adapter_id, spec)

    for adapter_id in ("a", "b"):
        for _ in range(2):
            sequential.forward_backward(adapter_id, data[adapter_id])
            sequential.optim_step(adapter_id, AdamParams(learning_rate=1e-2))
    for _ in range(2):
        interleaved.forward_backward("a", data["a"])
        interleaved.forward_backward("b", data["b"])
        interleaved.optim_step("a", AdamParams(learning_rate=1e-2))
        interleaved.optim_step("b", AdamParams(learning_rate=1e-2))

    for adapter_id in ("a", "b"):
        if ON_CPU:
            assert_same(adapter_tensors(interleaved, adapter_id), adapter_tensors(sequential, adapter_id))
        else:
            for a, b in zip(
                adapter_tensors(interleaved, adapter_id).values(),
                adapter_tensors(sequential, adapter_id).values(),
                strict=True,
            ):
                torch.testing.assert_close(a, b)


def test_the_same_seed_gives_the_same_initial_adapter(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=5))
    backend.create_adapter("b", LoraSpec(rank=4, seed=5))
    backend.create_adapter("c", LoraSpec(rank=4, seed=6))
    assert_same(adapter_tensors(backend, "a"), adapter_tensors(backend, "b"))
    assert any(
        not torch.equal(x, y)
        for x, y in zip(adapter_tensors(backend, "a").values(), adapter_tensors(backend, "c").values(), strict=True)
    )


def test_lora_flags_choose_the_target_modules(backend: TransformersBackend) -> None:
    backend.create_adapter("attn", LoraSpec(rank=2, train_mlp=False, train_unembed=False))
    backend.create_adapter("head", LoraSpec(rank=2, train_attn=False, train_mlp=False))
    attn = {key.split(".")[-3] for key in adapter_tensors(backend, "attn")}
    head = {key.split(".")[-3] for key in adapter_tensors(backend, "head")}
    assert attn == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert head == {"lm_head"}
    with pytest.raises(InvalidRequest, match="no target modules"):
        backend.create_adapter("none", LoraSpec(train_attn=False, train_mlp=False, train_unembed=False))
    with pytest.raises(InvalidRequest, match="Cannot build"):
        backend.create_adapter("bad", LoraSpec(target_modules=("no_such_proj",)))
    assert not backend.has_adapter("bad")


def test_max_loras_is_a_hard_wall_when_paging_is_off(make_backend: BackendFactory) -> None:
    backend = make_backend(max_loras=2, paging=PagingBudget(host_bytes=0, disk_bytes=0))
    backend.create_adapter("a", LoraSpec(rank=2))
    backend.create_adapter("b", LoraSpec(rank=2))
    with pytest.raises(LimitExceeded, match=r"All 2 LoRA slots .*paging is off"):
        backend.create_adapter("c", LoraSpec(rank=2))
    backend.remove_adapter("a")
    backend.create_adapter("c", LoraSpec(rank=2))
    assert backend.has_adapter("c") and not backend.has_adapter("a")


def test_removing_adapters_frees_their_weights_and_optimizer(backend: TransformersBackend) -> None:
    def parameter_count() -> int:
        return sum(param.numel() for param in backend.shared.base.model.parameters())

    backend.create_adapter("keep", LoraSpec(rank=4))
    baseline = parameter_count()
    probes = []
    for cycle in range(3):
        backend.create_adapter(f"temp{cycle}", LoraSpec(rank=16))
        train(backend, f"temp{cycle}", steps=1)
        tenant = backend.tenants[f"temp{cycle}"]
        probes += [weakref.ref(tenant.optimizer), weakref.ref(tenant.params[0])]
        del tenant
        backend.remove_adapter(f"temp{cycle}")
        assert parameter_count() == baseline
    gc.collect()
    assert all(probe() is None for probe in probes)
    backend.remove_adapter("unknown")  # ignored


# Checkpoints


def test_load_state_resumes_training_exactly(make_backend: BackendFactory, tmp_path: Path) -> None:
    spec = LoraSpec(rank=4, seed=3, dropout=0.1)
    first = make_backend()
    first.create_adapter("a", spec)
    train(first, "a", steps=3)
    first.save_state("a", tmp_path / "ckpt", include_optimizer=True)
    continued = train(first, "a", steps=3)

    resumed_backend = make_backend()
    resumed_backend.create_adapter("a", LoraSpec(rank=4, seed=99, dropout=0.1))
    resumed_backend.load_state("a", tmp_path / "ckpt", include_optimizer=True)
    resumed = train(resumed_backend, "a", steps=3)

    if ON_CPU:
        assert resumed == continued
    else:
        assert resumed == pytest.approx(continued, rel=1e-5)
    assert resumed_backend.tenants["a"].steps == 6
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["steps"] == 3


def test_load_state_without_optimizer_restores_weights_and_resets_moments(
    backend: TransformersBackend, tmp_path: Path
) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=3))
    train(backend, "a", steps=2)
    backend.save_state("a", tmp_path / "weights", include_optimizer=False)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    saved = adapter_tensors(backend, "a")
    train(backend, "a", steps=2)

    backend.load_state("a", tmp_path / "weights", include_optimizer=False)

    assert_same(adapter_tensors(backend, "a"), saved)
    assert backend.tenants["a"].optimizer.state_dict()["state"] == {}
    with pytest.raises(InvalidRequest, match="no optimizer state"):
        backend.load_state("a", tmp_path / "weights", include_optimizer=True)


def test_load_state_rejects_a_checkpoint_of_another_shape(backend: TransformersBackend, tmp_path: Path) -> None:
    backend.create_adapter("r4", LoraSpec(rank=4))
    backend.create_adapter("r8", LoraSpec(rank=8))
    backend.save_state("r4", tmp_path / "r4", include_optimizer=False)
    with pytest.raises(InvalidRequest, match="rank 4"):
        backend.load_state("r8", tmp_path / "r4", include_optimizer=False)
    with pytest.raises(InvalidRequest, match="not an adapter checkpoint"):
        backend.load_state("r8", tmp_path / "missing", include_optimizer=False)
    assert read_lora_spec(tmp_path / "r4").rank == 4


def test_sampler_weights_load_into_a_plain_peft_model(
    backend: TransformersBackend, tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=1))
    train(backend, "a", steps=2)
    backend.save_weights_for_sampler("a", tmp_path / "sampler")
    datum = ce_datum(PATTERN[:15])
    expected = backend.forward("a", ce_batch(datum)).loss_fn_outputs[0]["logprobs"]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "sampler").to(TEST_DEVICE).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PATTERN[:14]], device=TEST_DEVICE)).logits[0].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(PATTERN[1:15], device=TEST_DEVICE)[:, None])[:, 0]

    np.testing.assert_allclose(logprobs.cpu().numpy(), expected, atol=1e-5)


# Twinkle losses


def test_dpo_starts_at_log_2_per_pair_and_learns_to_prefer_the_chosen_answer(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=8, seed=1))
    prompt = PATTERN[:6]
    chosen, rejected = prompt + PATTERN[6:12], [*prompt, 300, 301, 302, 303, 304, 305]
    completion = [0.0] * 5 + [1.0] * 6
    batch = ForwardBackwardInput([ce_datum(chosen, completion), ce_datum(rejected, completion)] * 2, "dpo")

    first = backend.forward_backward("a", batch)
    backend.optim_step("a", AdamParams(learning_rate=1e-2))
    for _ in range(3):
        backend.forward_backward("a", batch)
        backend.optim_step("a", AdamParams(learning_rate=1e-2))
    last = backend.forward("a", batch)

    # A fresh LoRA (B = 0) is the reference model itself: every reward is zero.
    assert first.metrics["loss:sum"] == pytest.approx(2 * math.log(2), rel=1e-5)
    assert first.metrics["dpo_margin:mean"] == pytest.approx(0.0, abs=1e-5)
    assert last.metrics["dpo_accuracy:mean"] == 1.0
    assert last.metrics["dpo_margin:mean"] > 0.1
    assert last.metrics["loss:sum"] < first.metrics["loss:sum"]


def test_grpo_with_kl_penalises_drift_from_the_base_model(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=8, seed=1))
    tokens = PATTERN[:12]
    old = backend.forward("a", ce_batch(ce_datum(tokens))).loss_fn_outputs[0]["logprobs"]
    inputs = {"target_tokens": np.asarray(tokens[1:]), "logprobs": old, "advantages": np.ones(11, np.float32)}
    datum = Datum(chunks_from_tokens(tokens[:-1]), inputs)
    train(backend, "a", steps=3)

    ppo = backend.forward("a", ForwardBackwardInput([datum], "ppo"))
    grpo_plain = backend.forward("a", ForwardBackwardInput([datum], "grpo"))
    grpo_kl = backend.forward("a", ForwardBackwardInput([datum], "grpo", {"kl_beta": 1.0}))

    assert grpo_plain.metrics["loss:sum"] == pytest.approx(ppo.metrics["loss:sum"], rel=1e-6)
    assert grpo_kl.metrics["kl:mean"] > 0
    assert grpo_kl.metrics["loss:sum"] == pytest.approx(
        ppo.metrics["loss:sum"] + 11 * grpo_kl.metrics["kl:mean"], rel=1e-4
    )


# Sampling


def test_sampling_after_training_reproduces_the_pattern_greedily(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=8, seed=1))
    train(backend, "a", steps=20)
    request = SampleRequest(
        chunks_from_tokens(PATTERN[:3]), SamplingParams(max_tokens=12, temperature=0, stop_at_eos=False)
    )

    (output,) = backend.sample("a", [request])

    assert output.sequences[0].tokens == PATTERN[3:15]
    assert output.sequences[0].stop_reason == "length"


def test_prompt_logprobs_from_sampling_equal_forward_logprobs(backend: TransformersBackend) -> None:
    backend.create_adapter("a", LoraSpec(rank=4, seed=1))
    train(backend, "a", steps=2)
    tokens = PATTERN[2:20]
    request = SampleRequest(chunks_from_tokens(tokens), SamplingParams(max_tokens=1), prompt_logprobs=True)

    (output,) = backend.sample("a", [request])
    forward = backend.forward("a", ce_batch(ce_datum(tokens))).loss_fn_outputs[0]["logprobs"]

    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    np.testing.assert_allclose(np.array(output.prompt_logprobs[1:], dtype=np.float64), forward, atol=1e-4)
    base = backend.sample(None, [request])[0].prompt_logprobs
    assert base is not None and not np.allclose(np.array(base[1:], dtype=np.float64), forward, atol=1e-4)
