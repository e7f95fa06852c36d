"""The real Tinker SDK 0.38, unmodified, against a launched Twinkle server.

The conformance flow it follows: docs/tinker_protocol.md#conformance-flow.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.harness import LaunchedServer, launch

pytestmark = pytest.mark.e2e
BASE = "tiny-qwen"


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def rl_datum(tokens: list[int], advantage: float) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [-2.0] * n,
                                       "advantages": [advantage] * n})


BATCH = [datum([5 + (i * 3 + k) % 40 for i in range(16)]) for k in range(4)]


@pytest.fixture(scope="module")
def service(server: LaunchedServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-sdk-e2e")
    yield client


def train(tc: tinker.TrainingClient, steps: int, lr: float = 0.05) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(BATCH, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def test_the_conformance_flow_runs_unmodified(service: tinker.ServiceClient, server: LaunchedServer) -> None:
    caps = tinker.RestClient(base_url=server.base_url, api_key="tml-sdk-e2e").get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    assert caps.supported_models[0].max_context_length == 2048

    tc = service.create_lora_training_client(base_model=BASE, rank=8).result()
    info = tc.get_info()
    assert info.model_data.tokenizer_id and Path(info.model_data.tokenizer_id).is_dir()
    assert tc.model_id.endswith(":train:0")

    fb = tc.forward_backward(BATCH, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0))
    out = fb.result()
    assert len(out.loss_fn_outputs) == len(BATCH)
    assert list(out.loss_fn_outputs[0]["logprobs"].shape) == [15]
    assert opt.result().metrics["grad_norm:mean"] > 0

    fwd = tc.forward(BATCH, "cross_entropy").result()
    assert np.all(fwd.loss_fn_outputs[0]["logprobs"].to_numpy() <= 0)
    ppo = tc.forward_backward([rl_datum([1, 2, 3, 4, 5], 1.0)], "ppo",
                              {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
    assert "loss:sum" in ppo.metrics
    for loss in ("importance_sampling", "cispo", "dro"):
        assert "loss:sum" in tc.forward([rl_datum([1, 2, 3, 4, 5], -0.5)], loss).result().metrics

    saved = tc.save_state("ckpt-1").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/ckpt-1"
    tc.load_state(saved.path).result()
    tc.load_state_with_optimizer(saved.path).result()

    named = tc.save_weights_for_sampler("samp-1").result()
    assert named.path.endswith("/sampler_weights/samp-1")
    sampler = tc.save_weights_and_get_sampling_client().result()
    result = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                            types.SamplingParams(max_tokens=3, temperature=0.7, stop=["\n"]),
                            include_prompt_logprobs=True).result()
    assert len(result.sequences) == 2 and all(1 <= len(s.tokens) <= 3 for s in result.sequences)
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()
    assert logprobs[0] is None and all(lp is not None and lp <= 0 for lp in logprobs[1:])

    from_path = service.create_sampling_client(model_path=named.path).result()
    assert len(from_path.sample(types.ModelInput.from_ints([5]), 1,
                                types.SamplingParams(max_tokens=2)).result().sequences) == 1
    base_sampler = service.create_sampling_client(base_model=BASE).result()
    assert base_sampler.sample(types.ModelInput.from_ints([5]), 1, types.SamplingParams(max_tokens=2)).result()

    restored = service.create_training_client_from_state(saved.path).result()
    assert restored.model_id.endswith(":train:1")
    restored_opt = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert restored_opt.get_info().lora_rank == 8

    rest = service.create_rest_client()
    runs = rest.list_training_runs().result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    checkpoints = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.checkpoint_id for c in checkpoints} >= {"weights/ckpt-1", "sampler_weights/samp-1"}
    assert rest.list_user_checkpoints().result().checkpoints
    run = rest.get_training_run(tc.model_id).result()
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == saved.path
    info = rest.get_weights_info_by_tinker_path(saved.path).result()
    assert info.lora_rank == 8 and info.is_lora
    rest.publish_checkpoint_from_tinker_path(saved.path).result()
    assert [c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints
            if c.checkpoint_id == "weights/ckpt-1"] == [True]
    rest.unpublish_checkpoint_from_tinker_path(saved.path).result()
    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    assert "weights/ckpt-1" not in {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}


def test_resume_from_save_state_continues_the_loss_trajectory_bit_for_bit(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    train(tc, 3)
    path = tc.save_state("resume-point").result().path
    uninterrupted = train(tc, 4)
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert train(resumed, 4) == uninterrupted
    weights_only = service.create_training_client_from_state(path).result()
    assert train(weights_only, 4) != uninterrupted  # fresh Adam moments: a different trajectory


def test_sampling_from_a_saved_step_reflects_the_training_at_that_step(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    cycle = [10, 11, 12, 13] * 6
    data = [datum(cycle)]
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    before = tc.save_weights_and_get_sampling_client().result().sample(types.ModelInput.from_ints([10, 11]), 1, params)
    for _ in range(40):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    after = tc.save_weights_and_get_sampling_client().result().sample(types.ModelInput.from_ints([10, 11]), 1, params)
    assert after.result().sequences[0].tokens == [12, 13, 10, 11, 12, 13, 10, 11]
    assert before.result().sequences[0].tokens != after.result().sequences[0].tokens


def test_a_failed_future_raises_request_failed_error_and_the_next_request_works(
        service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    tc.save_state("taken").result()
    with pytest.raises(tinker.RequestFailedError) as failure:
        tc.save_state("taken").result()
    assert "already exists" in str(failure.value)
    assert failure.value.category == types.RequestErrorCategory.User
    assert tc.forward_backward(BATCH, "cross_entropy").result().metrics["loss:sum"] > 0


def test_unknown_loss_names_are_refused_with_the_supported_list(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError)) as failure:
        tc.forward_backward(BATCH, "nonsense").result()
    assert "cross_entropy" in str(failure.value)


@pytest.fixture(scope="module")
def chunking_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    server = launch(tmp_path_factory.mktemp("chunks"), tiny_model_dir, db=12, adapter_config={"adapter_timeout": 12},
                    env={"TWINKLE_TINKER_CLIENT_CONFIG": '{"fwdbwd_max_chunk_len": 1, "proto_compress_fwdbwd": true}'})
    yield server
    server.stop()


def test_chunk_bursts_accumulate_like_one_batch(chunking_server: LaunchedServer, mock_server: LaunchedServer) -> None:
    chunked = tinker.ServiceClient(base_url=chunking_server.base_url, api_key="tml-chunks")
    whole = tinker.ServiceClient(base_url=mock_server.base_url, api_key="tml-chunks")
    a = chunked.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    b = whole.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    losses_a = train(a, 3)
    losses_b = train(b, 3)
    assert np.allclose(losses_a, losses_b, rtol=1e-5)  # float32 sums in another order


def test_an_idle_clients_heartbeats_keep_its_model_alive_while_a_silent_sessions_model_is_unloaded(
        chunking_server: LaunchedServer) -> None:
    client = tinker.ServiceClient(base_url=chunking_server.base_url, api_key="tml-idle")
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with chunking_server.client("tml-silent") as raw:
        sid = raw.post("/create_session", json={"tags": []}).json()["session_id"]
        silent = raw.post("/create_model", json={"session_id": sid, "base_model": BASE}).json()["model_id"]
        time.sleep(21)  # past the 12 s adapter_timeout; the SDK heartbeats every 10 s, the raw client never
        assert tc.forward_backward(BATCH, "cross_entropy").result().metrics["loss:sum"] > 0
        gone = raw.post("/optim_step", json={"model_id": silent, "adam_params": {}})
        assert gone.status_code == 404
        assert "heartbeat" in gone.json()["error"]


def test_a_client_side_custom_loss_trains_through_forward_backward_custom(service: tinker.ServiceClient) -> None:
    import torch

    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()

    def mean_nll(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -torch.cat(logprobs).mean()
        return loss, {"mean_nll:mean": float(loss.detach())}

    first = tc.forward_backward_custom(BATCH, mean_nll).result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    for _ in range(5):
        last = tc.forward_backward_custom(BATCH, mean_nll).result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert last.metrics["mean_nll:mean"] < first.metrics["mean_nll:mean"]


SDK_SCRIPT = """
import sys
from pathlib import Path
import tinker
from tinker import types
service = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-transport")
tc = service.create_lora_training_client(base_model=sys.argv[2], rank=4).result()
tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                                 loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3})],
                   "cross_entropy").result()
print(sorted({task.joinpath("comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}))
"""


@pytest.mark.parametrize("flags, tokio_threads", [(None, False), ('{"use_pyqwest_transport": true}', True)])
def test_the_sdk_runs_no_rust_transport_threads_that_could_abort_it_at_exit_unless_the_operator_asks(
        tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, flags: str | None,
        tokio_threads: bool) -> None:
    env = {"TWINKLE_TINKER_CLIENT_CONFIG": flags} if flags else {}
    server = launch(tmp_path_factory.mktemp("transport"), tiny_model_dir, db=13, env=env)
    try:
        done = subprocess.run([sys.executable, "-c", SDK_SCRIPT, server.base_url, BASE],
                              capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    assert ("tokio-rt-worker" in done.stdout) is tokio_threads, done.stdout
