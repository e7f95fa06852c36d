"""The megatron backend against the transformers backend on tiny models, run on the CPU.

megatron-core is GPU software; these tests run its CPU-capable local layers with the adjustments in
`twinkle.backends.megatron.cpu_support`, in this process or as two gloo ranks. They are skipped where the
`megatron` extra is not installed; the requirement checks at the end run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from twinkle.backends.megatron import requirements
from twinkle.backends.megatron.parallel import ParallelSizes
from twinkle.errors import InvalidRequest, LimitExceeded, NotFound
from twinkle.types import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    LoraSpec,
    SampleRequest,
    SamplingParams,
    chunks_from_tokens,
)

if TYPE_CHECKING:
    from twinkle.backends.megatron_backend import MegatronBackend
    from twinkle.backends.transformers_backend import TransformersBackend

HAS_MEGATRON = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)
needs_megatron = pytest.mark.skipif(
    not HAS_MEGATRON, reason="megatron-core is not installed (extra: megatron)"
)
REPO = Path(__file__).resolve().parents[3]
# TWINKLE_TEST_DEVICE=cuda runs the single-process comparisons on a GPU (the two-rank ones stay on gloo/CPU).
TEST_DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")
TOKENS = list(range(100, 110)) * 3
SPEC = LoraSpec(rank=4, seed=11)


def ce_datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    inputs = {"target_tokens": np.asarray(tokens[1:], np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, np.float32)
    return Datum(chunks_from_tokens(tokens[:-1]), inputs)


def mixed_batch() -> ForwardBackwardInput:
    """Three datums of different lengths (so two are padded), one with loss weights."""
    return ForwardBackwardInput(
        [ce_datum(TOKENS), ce_datum(TOKENS[3:12], [0, 0, 1, 1, 1, 1, 1, 1]), ce_datum(TOKENS[5:20])]
    )


def rl_batch(loss_fn: str) -> ForwardBackwardInput:
    rng = np.random.default_rng(0)
    data = []
    for length in (12, 7):
        tokens = TOKENS[: length + 1]
        inputs = {
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "logprobs": rng.uniform(-6, -3, length).astype(np.float32),
            "advantages": rng.normal(size=length).astype(np.float32),
        }
        data.append(Datum(chunks_from_tokens(tokens[:-1]), inputs))
    return ForwardBackwardInput(data, loss_fn)


def assert_outputs_close(left: list[dict[str, np.ndarray]], right: list[dict[str, np.ndarray]]) -> None:
    assert len(left) == len(right)
    for ours, theirs in zip(left, right, strict=True):
        assert ours.keys() == theirs.keys()
        for key in ours:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=2e-5)


@pytest.fixture(scope="module")
def megatron(tiny_model_dir: Path) -> MegatronBackend:
    from twinkle.backends.megatron_backend import MegatronBackend

    torch.set_num_threads(1)  # tiny matrices: threads only add contention on the test box
    return MegatronBackend(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> TransformersBackend:
    from twinkle.backends.transformers_backend import TransformersBackend

    return TransformersBackend(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE)


@pytest.fixture
def paired(megatron: MegatronBackend, hf: TransformersBackend, tmp_path: Path) -> Iterator[str]:
    """One adapter id on both backends holding the same nonzero LoRA weights (B random, not zero)."""
    adapter_id = "paired"
    megatron.create_adapter(adapter_id, SPEC)
    hf.create_adapter(adapter_id, SPEC)
    generator = torch.Generator().manual_seed(5)
    tenant = megatron.tenants[adapter_id]
    state = {
        key: torch.randn(value.shape, generator=generator) * 0.05
        for key, value in megatron.bank.local_state(tenant.name).items()
    }
    megatron.bank.load_local_state(tenant.name, state)
    megatron.save_state(adapter_id, tmp_path / "start", include_optimizer=False)
    hf.load_state(adapter_id, tmp_path / "start", include_optimizer=False)
    yield adapter_id
    megatron.remove_adapter(adapter_id)
    hf.remove_adapter(adapter_id)


# Same numbers as the transformers backend


@needs_megatron
def test_forward_gives_the_transformers_backends_logprobs_and_loss(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str
) -> None:
    ours, theirs = megatron.forward(paired, mixed_batch()), hf.forward(paired, mixed_batch())
    assert_outputs_close(ours.loss_fn_outputs, theirs.loss_fn_outputs)
    assert ours.metrics["loss:sum"] == pytest.approx(theirs.metrics["loss:sum"], rel=1e-5)
    assert [len(output["logprobs"]) for output in ours.loss_fn_outputs] == [29, 8, 14]


@needs_megatron
def test_forward_with_disable_lora_reads_the_base_model_like_the_transformers_backend(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str
) -> None:
    for backend in (megatron, hf):
        backend.forward_backward(paired, mixed_batch())
        backend.optim_step(paired, AdamParams(learning_rate=5e-2))  # the adapter now changes the logprobs
    base_only = replace(mixed_batch(), disable_lora=True)
    ours, theirs = megatron.forward(paired, base_only), hf.forward(paired, base_only)
    assert_outputs_close(ours.loss_fn_outputs, theirs.loss_fn_outputs)
    trained = megatron.forward(paired, mixed_batch()).loss_fn_outputs
    assert not np.allclose(trained[0]["logprobs"], ours.loss_fn_outputs[0]["logprobs"], atol=1e-3)


@needs_megatron
def test_training_steps_follow_the_transformers_backend(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str
) -> None:
    steps = [
        AdamParams(learning_rate=1e-2),
        AdamParams(learning_rate=1e-2, grad_clip_norm=1.0),
        AdamParams(5e-3),
    ]
    for params in steps:
        ours, theirs = (
            megatron.forward_backward(paired, mixed_batch()),
            hf.forward_backward(paired, mixed_batch()),
        )
        assert ours.metrics["loss:sum"] == pytest.approx(theirs.metrics["loss:sum"], rel=1e-5)
        ours_step, theirs_step = megatron.optim_step(paired, params), hf.optim_step(paired, params)
        assert ours_step["grad_norm:mean"] == pytest.approx(theirs_step["grad_norm:mean"], rel=1e-4)
    first, last = megatron.forward(paired, mixed_batch()), hf.forward(paired, mixed_batch())
    assert_outputs_close(first.loss_fn_outputs, last.loss_fn_outputs)


@needs_megatron
@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_tinker_rl_losses_on_megatron_logits_match(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str, loss_fn: str
) -> None:
    ours, theirs = (
        megatron.forward_backward(paired, rl_batch(loss_fn)),
        hf.forward_backward(paired, rl_batch(loss_fn)),
    )
    assert ours.metrics.keys() == theirs.metrics.keys()
    for name, value in theirs.metrics.items():
        assert ours.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-5)
    assert_outputs_close(ours.loss_fn_outputs, theirs.loss_fn_outputs)
    ours_step = megatron.optim_step(paired, AdamParams())
    assert ours_step["grad_norm:mean"] == pytest.approx(
        hf.optim_step(paired, AdamParams())["grad_norm:mean"], rel=1e-4
    )


@needs_megatron
def test_dpo_reads_the_base_model_as_reference_like_the_transformers_backend(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str
) -> None:
    batch = ForwardBackwardInput([ce_datum(TOKENS[:12]), ce_datum(TOKENS[4:16])], "dpo")
    ours, theirs = megatron.forward(paired, batch), hf.forward(paired, batch)
    for name, value in theirs.metrics.items():
        assert ours.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert theirs.metrics["dpo_margin:mean"] != 0  # the adapter moved the policy away from the reference


@needs_megatron
def test_top_k_targets_give_logprobs_of_their_shape(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str
) -> None:
    targets = np.stack([np.asarray(TOKENS[1:9]), np.asarray(TOKENS[2:10])], axis=-1).astype(np.int64)
    batch = ForwardBackwardInput(
        [
            Datum(
                chunks_from_tokens(TOKENS[:8]),
                {"target_tokens": targets, "weights": np.ones((8, 2), np.float32)},
            )
        ]
    )
    ours, theirs = megatron.forward(paired, batch), hf.forward(paired, batch)
    assert ours.loss_fn_outputs[0]["logprobs"].shape == (8, 2)
    assert_outputs_close(ours.loss_fn_outputs, theirs.loss_fn_outputs)


@needs_megatron
def test_qwen2_with_qkv_biases_and_tied_embeddings_matches_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from twinkle.backends.megatron_backend import MegatronBackend
    from twinkle.backends.transformers_backend import TransformersBackend

    directory = tmp_path / "tiny-qwen2"
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random, visible biases: a misplaced bias row changes the logprobs
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, directory / name)
    ours = MegatronBackend(str(directory), torch_dtype="float32", device=TEST_DEVICE, max_loras=1)
    theirs = TransformersBackend(str(directory), torch_dtype="float32", device=TEST_DEVICE, max_loras=1)
    ours.create_adapter("a", SPEC)
    theirs.create_adapter("a", SPEC)
    assert_outputs_close(
        ours.forward("a", mixed_batch()).loss_fn_outputs, theirs.forward("a", mixed_batch()).loss_fn_outputs
    )


# Checkpoints interchange with the transformers backend


@needs_megatron
def test_a_megatron_checkpoint_with_optimizer_continues_in_the_transformers_backend(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str, tmp_path: Path
) -> None:
    megatron.forward_backward(paired, mixed_batch())
    megatron.optim_step(paired, AdamParams(learning_rate=1e-2))
    megatron.save_state(paired, tmp_path / "trained", include_optimizer=True)
    hf.load_state(paired, tmp_path / "trained", include_optimizer=True)
    assert hf.tenants[paired].steps == 1
    for backend in (megatron, hf):
        backend.forward_backward(paired, mixed_batch())
        backend.optim_step(paired, AdamParams(learning_rate=1e-2))
    assert_outputs_close(
        megatron.forward(paired, mixed_batch()).loss_fn_outputs,
        hf.forward(paired, mixed_batch()).loss_fn_outputs,
    )


@needs_megatron
def test_a_transformers_checkpoint_with_optimizer_continues_in_the_megatron_backend(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str, tmp_path: Path
) -> None:
    hf.forward_backward(paired, mixed_batch())
    hf.optim_step(paired, AdamParams(learning_rate=1e-2))
    hf.save_state(paired, tmp_path / "trained", include_optimizer=True)
    megatron.load_state(paired, tmp_path / "trained", include_optimizer=True)
    assert megatron.tenants[paired].steps == 1
    for backend in (megatron, hf):
        backend.forward_backward(paired, mixed_batch())
        backend.optim_step(paired, AdamParams(learning_rate=1e-2))
    assert_outputs_close(
        megatron.forward(paired, mixed_batch()).loss_fn_outputs,
        hf.forward(paired, mixed_batch()).loss_fn_outputs,
    )


@needs_megatron
def test_loading_a_checkpoint_of_another_rank_is_refused(
    megatron: MegatronBackend, paired: str, tmp_path: Path
) -> None:
    megatron.save_state(paired, tmp_path / "rank4", include_optimizer=False)
    megatron.create_adapter("rank8", LoraSpec(rank=8))
    try:
        with pytest.raises(InvalidRequest, match=r"rank 4, alpha 32.0\) does not fit .* \(rank 8"):
            megatron.load_state("rank8", tmp_path / "rank4", include_optimizer=False)
    finally:
        megatron.remove_adapter("rank8")


@needs_megatron
def test_sampling_uses_the_adapters_current_weights(
    megatron: MegatronBackend, hf: TransformersBackend, paired: str
) -> None:
    request = SampleRequest(
        chunks_from_tokens(TOKENS[:6]), SamplingParams(max_tokens=6, temperature=0.0), num_samples=2
    )
    ours, theirs = megatron.sample(paired, [request])[0], hf.sample(paired, [request])[0]
    assert [sequence.tokens for sequence in ours.sequences] == [
        sequence.tokens for sequence in theirs.sequences
    ]
    np.testing.assert_allclose(ours.sequences[0].logprobs, theirs.sequences[0].logprobs, atol=1e-5)
    assert request.adapter_path is None  # the caller's request is left as it was


# Adapters and limits


@needs_megatron
def test_adapter_slots_and_unknown_ids_are_enforced(tiny_model_dir: Path) -> None:
    from twinkle.backends.megatron_backend import MegatronBackend

    backend = MegatronBackend(str(tiny_model_dir), torch_dtype="float32", device=TEST_DEVICE, max_loras=1)
    backend.create_adapter("one", LoraSpec(rank=2))
    with pytest.raises(LimitExceeded, match="All 1 LoRA slots"):
        backend.create_adapter("two", LoraSpec(rank=2))
    with pytest.raises(InvalidRequest, match="already exists"):
        backend.create_adapter("one", LoraSpec(rank=2))
    with pytest.raises(NotFound):
        backend.forward("two", mixed_batch())
    backend.remove_adapter("one")
    backend.create_adapter("two", LoraSpec(rank=2, target_modules=("q_proj", "v_proj")))
    assert (
        len(backend.bank.adapter(backend.tenants["two"].name).parameters()) == 2 * 2 * 2
    )  # 2 layers x q, v x A, B
    backend.remove_adapter("two")
    with pytest.raises(InvalidRequest, match="embed_tokens"):
        backend.create_adapter("three", LoraSpec(target_modules=("embed_tokens",)))


@needs_megatron
def test_adapters_do_not_leak_into_each_other_or_the_base(megatron: MegatronBackend, paired: str) -> None:
    base = megatron.forward(paired, mixed_batch())
    megatron.create_adapter("other", LoraSpec(rank=4, seed=1))  # B = 0: the base model's logprobs
    try:
        fresh = megatron.forward("other", mixed_batch())
        again = megatron.forward(paired, mixed_batch())
    finally:
        megatron.remove_adapter("other")
    assert_outputs_close(again.loss_fn_outputs, base.loss_fn_outputs)
    assert not np.allclose(fresh.loss_fn_outputs[0]["logprobs"], base.loss_fn_outputs[0]["logprobs"])


# Parallel ranks


_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from types import SimpleNamespace
    import numpy as np, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[1])
    from tests.twinkle.backends.test_megatron_backend import mixed_batch, SPEC
    from twinkle.backends.megatron_backend import MegatronBackend
    from twinkle.types import AdamParams
    model_dir, start, out = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    tp, dp = int(sys.argv[5]), int(sys.argv[6])
    backend = MegatronBackend(model_dir, torch_dtype="float32", device="cpu",
                              device_mesh=SimpleNamespace(tp_size=tp, dp_size=dp))
    backend.create_adapter("a", SPEC)
    backend.load_state("a", start, include_optimizer=False)
    first = backend.forward_backward("a", mixed_batch())
    step = backend.optim_step("a", AdamParams(learning_rate=1e-2, grad_clip_norm=5.0))
    second = backend.forward("a", mixed_batch())
    backend.save_state("a", out / "saved", include_optimizer=True)
    rank = torch.distributed.get_rank()
    result = {"first": first.metrics, "step": step,
              "logprobs": [o["logprobs"].tolist() for o in second.loss_fn_outputs]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # both ranks leave the group together: a rank whose peer hung up first can abort in gloo's teardown
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (1, 2)])
def test_two_ranks_compute_what_one_rank_computes(
    megatron: MegatronBackend, paired: str, tiny_model_dir: Path, tmp_path: Path, tp: int, dp: int
) -> None:
    """Two gloo processes (tensor- or data-parallel) step and save like the single-process backend."""
    megatron.save_state(paired, tmp_path / "start", include_optimizer=False)
    (tmp_path / "out").mkdir()
    port = free_port()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RANK_SCRIPT,
                str(REPO),
                str(tiny_model_dir),
                str(tmp_path / "start"),
                str(tmp_path / "out"),
                str(tp),
                str(dp),
            ],
            env={
                **_environ(),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [process.communicate(timeout=240)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), "\n".join(log[-3000:] for log in logs)
    first = megatron.forward_backward(paired, mixed_batch())
    step = megatron.optim_step(paired, AdamParams(learning_rate=1e-2, grad_clip_norm=5.0))
    second = megatron.forward(paired, mixed_batch())
    for rank in range(2):
        result = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert result["first"]["loss:sum"] == pytest.approx(first.metrics["loss:sum"], rel=1e-5)
        assert result["step"]["grad_norm:mean"] == pytest.approx(step["grad_norm:mean"], rel=1e-4)
        for ours, theirs in zip(result["logprobs"], second.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(ours, theirs["logprobs"], rtol=1e-5, atol=2e-5)
    megatron.save_state(paired, tmp_path / "single", include_optimizer=True)
    from safetensors.torch import load_file

    saved, single = (
        load_file(str(tmp_path / "out" / "saved" / "adapter_model.safetensors")),
        load_file(str(tmp_path / "single" / "adapter_model.safetensors")),
    )
    assert saved.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(saved[key], single[key], rtol=1e-4, atol=1e-6)


def free_port() -> int:
    """A free local TCP port for the ranks' rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _environ() -> dict[str, str]:
    return {
        key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }


@needs_megatron
def test_a_mesh_larger_than_the_started_processes_is_refused(tiny_model_dir: Path) -> None:
    from twinkle.backends.megatron_backend import MegatronBackend

    with pytest.raises(InvalidRequest, match=r"device_mesh covers 2 ranks .* but 1 processes were started"):
        MegatronBackend(str(tiny_model_dir), device=TEST_DEVICE, device_mesh=SimpleNamespace(dp_size=2))


# What runs everywhere


def test_pipeline_context_and_expert_parallelism_are_refused_with_the_reason() -> None:
    sizes = ParallelSizes.from_mesh(SimpleNamespace(dp_size=2, tp_size=2, pp_size=2, cp_size=1, ep_size=2))
    assert sizes.world_size == 8
    problems = sizes.problems()
    assert problems[0].startswith("pp_size=2: pipeline parallelism needs Megatron's pipeline schedule")
    assert problems[1] == "ep_size=2: expert parallelism applies to mixture-of-experts models only"
    assert ParallelSizes.from_mesh(SimpleNamespace(dp_size=4, tp_size=2)).problems() == []


def test_missing_megatron_core_and_gpu_are_named_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        requirements.importlib.util,
        "find_spec",
        lambda name: None if name.startswith("megatron") else real_find_spec(name),
    )
    monkeypatch.setattr(torch.version, "cuda", None)
    assert requirements.megatron_requirements_problem() == (
        "backend: megatron needs megatron-core (pip install 'twinkle[megatron]') and a CUDA GPU; found: "
        f"megatron-core is not installed; torch {torch.__version__} is a CPU-only build (no CUDA)."
    )


def test_a_cuda_build_without_a_visible_gpu_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    problem = requirements.megatron_requirements_problem()
    assert problem is not None and problem.endswith(
        f"torch {torch.__version__} (CUDA 12.8) sees no CUDA GPU."
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_building_the_backend_without_a_gpu_says_what_is_missing(tiny_model_dir: Path) -> None:
    from twinkle.backends.megatron_backend import MegatronBackend

    with pytest.raises(
        InvalidRequest, match=r"^backend: megatron needs megatron-core .* and a CUDA GPU; found: .*CUDA"
    ):
        MegatronBackend(str(tiny_model_dir))


def test_importing_the_backend_does_not_import_megatron_core() -> None:
    code = (
        "import sys, twinkle.backends.megatron_backend, twinkle.backends.megatron.requirements;"
        "print(sorted(name for name in sys.modules"
        " if name.split('.')[0] in ('megatron', 'transformer_engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
    light = "import sys, twinkle.backends.megatron.requirements; print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", light], capture_output=True, text=True, check=True, cwd=REPO
        ).stdout.strip()
        == "False"
    )
