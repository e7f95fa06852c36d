"""A Ray device group of two data-parallel ranks trains exactly like one replica on the whole batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from twinkle.config import parse_config
from twinkle.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec, chunks_from_tokens
from workers.factory import build_model_backend, on_loopback

pytestmark = pytest.mark.slow


def model_app(model_dir: Path, backend: str, dp_size: int, deployments: list[dict[str, Any]] | None = None) -> Any:
    config = parse_config({"applications": [{
        "name": "models-tiny", "route_prefix": "/m", "import_path": "model",
        "args": {"backend": backend, "model_id": str(model_dir), "max_length": 256,
                 "device_group": {"ranks": dp_size, "device_type": "cpu"}, "device_mesh": {"dp_size": dp_size}},
        "deployments": deployments or [],
    }]})
    return config, config.app("models-tiny")


def batch(vocab: int, rows: int = 5, length: int = 12) -> ForwardBackwardInput:
    rng = np.random.default_rng(0)
    data = []
    for _ in range(rows):
        tokens = rng.integers(3, min(vocab, 400), size=length)
        data.append(Datum(model_input=chunks_from_tokens(tokens[:-1]),
                          loss_fn_inputs={"target_tokens": tokens[1:].astype(np.int64),
                                          "weights": np.ones(length - 1, np.float32)}))
    return ForwardBackwardInput(data)


def saved_arrays(backend: Any, directory: Path) -> dict[str, np.ndarray]:
    directory.mkdir()
    backend.save_state("a", directory, include_optimizer=False)
    return arrays_in(directory)


def arrays_in(directory: Path) -> dict[str, np.ndarray]:
    """Every array of a saved adapter: weights, and the optimizer moments when they were saved."""
    arrays: dict[str, np.ndarray] = {}
    for path in directory.glob("*.npz"):
        arrays.update(np.load(path))
    for path in directory.glob("*.safetensors"):
        arrays.update(load_file(path))
    if (directory / "optimizer.pt").exists():
        import torch

        state = torch.load(directory / "optimizer.pt", weights_only=False)
        for index, moments in state["state"].items():
            arrays.update({f"optimizer.{index}.{name}": np.asarray(value) for name, value in moments.items()})
    return arrays


LEARNING_RATE = 0.02
STEPS = 3
# How far a weight may differ between two data-parallel ranks and one replica after STEPS Adam steps.
# Splitting the batch over ranks reorders float32 additions (each rank sums its shard, the all-reduce adds the
# partial sums), so the gradients agree only to a relative GRAD_RTOL (the grad norms below are held to that).
# Adam normalises every coordinate on its own: each step moves a coordinate by about LEARNING_RATE whatever its
# size, and a relative error of the gradient becomes the same relative error of that step. A coordinate that
# ends near zero (seen: 8.6e-4, off by 1.09e-6) therefore differs by up to GRAD_RTOL x LEARNING_RATE per step in
# absolute terms, not relative to its own small value: 1e-4 x 0.02 x 3 = 6e-6.
GRAD_RTOL = 1e-4
WEIGHT_ATOL = GRAD_RTOL * LEARNING_RATE * STEPS


def assert_same_arrays(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], rtol: float,
                       atol: float) -> None:
    assert ours.keys() == theirs.keys() and ours
    for key in ours:
        if ours[key].dtype.kind == "f":
            np.testing.assert_allclose(ours[key], theirs[key], rtol=rtol, atol=atol, err_msg=key)
        else:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_two_data_parallel_ranks_give_the_loss_and_weights_of_one_replica_after_three_steps(
        ray_address: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The transformers backend on real Ray actors with gloo (the mock backend: test_data_parallel.py)."""
    backend = "transformers"
    from workers.device_group import start_device_group

    config, app = model_app(tiny_model_dir, backend, dp_size=2)
    deaths: list[str] = []
    parallel, _ = start_device_group(config, app, f"test-{backend}", on_death=deaths.append)
    try:
        check_equivalence(parallel, model_app(tiny_model_dir, backend, dp_size=1)[1], tmp_path)
    finally:
        parallel.ranks.close()  # type: ignore[attr-defined]
    assert not deaths


def check_equivalence(parallel: Any, single_app: Any, tmp_path: Path) -> None:
    single = build_model_backend(single_app.args)
    global_batch = batch(single.info.vocab_size)  # 5 datums: shards of 3 and 2
    spec = LoraSpec(rank=4, seed=11)
    losses: dict[str, list[float]] = {"parallel": [], "single": []}
    norms: dict[str, list[float]] = {"parallel": [], "single": []}
    for name, model in (("parallel", parallel), ("single", single)):
        model.create_adapter("a", spec)
        for _ in range(STEPS):
            out = model.forward_backward("a", global_batch)
            assert len(out.loss_fn_outputs) == 5
            losses[name].append(out.metrics["loss:sum"])
            norms[name].append(model.optim_step("a", AdamParams(learning_rate=LEARNING_RATE))["grad_norm:mean"])
    np.testing.assert_allclose(losses["parallel"], losses["single"], rtol=1e-5)
    np.testing.assert_allclose(norms["parallel"], norms["single"], rtol=GRAD_RTOL)
    assert losses["single"][2] < losses["single"][0]  # it trained
    assert_same_arrays(saved_arrays(parallel, tmp_path / "dp"), saved_arrays(single, tmp_path / "one"),
                       rtol=GRAD_RTOL, atol=WEIGHT_ATOL)
    # every rank holds the same weights and optimizer state, not only the one that writes checkpoints
    per_rank = []
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
        parallel.ranks.call(rank, "save_state", "a", str(tmp_path / f"rank{rank}"), True)
        per_rank.append(arrays_in(tmp_path / f"rank{rank}"))
    assert any(key.startswith(("optimizer.", "exp_avg")) for key in per_rank[0])
    assert_same_arrays(per_rank[0], per_rank[1], rtol=0, atol=1e-6)


def test_ray_actor_options_set_what_each_rank_reserves(ray_address: str, tiny_model_dir: Path) -> None:
    import ray

    from workers.device_group import start_device_group

    config, app = model_app(tiny_model_dir, "mock", dp_size=2, deployments=[{
        "name": "pinned", "ray_actor_options": {"num_cpus": 2, "resources": {"twinkle_test_node": 1}}}])
    parallel, _ = start_device_group(config, app, "test-actor-options", on_death=lambda _why: None)
    try:
        bundles = ray.util.placement_group_table(parallel.ranks.pg)["bundles"]  # type: ignore[attr-defined]
        assert list(bundles.values()) == [{"CPU": 2.0, "twinkle_test_node": 1.0}] * 2  # one per rank
    finally:
        parallel.ranks.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("options", "bundle"), [
    ({}, {"CPU": 1, "GPU": 1}),
    ({"num_cpus": 4, "num_gpus": 0.5}, {"CPU": 4, "GPU": 0.5}),
    ({"memory": 2e9, "resources": {"node_b": 1}}, {"CPU": 1, "GPU": 1, "memory": 2e9, "node_b": 1}),
])
def test_a_cuda_ranks_bundle_follows_ray_actor_options(options: dict[str, Any], bundle: dict[str, float]) -> None:
    from twinkle.config.deployment import RayActorOptions
    from workers.device_group import bundle_for

    assert bundle_for("cuda", RayActorOptions(**options)) == bundle


def test_the_ray_instance_listens_on_loopback_only(ray_address: str) -> None:
    import psutil

    assert ray_address.startswith("127.0.0.1:")
    ours = {p.pid for p in psutil.Process().children(recursive=True)}  # gcs_server, raylet, its workers
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert listening
    exposed = [(c.laddr.ip, c.laddr.port, _describe(c.pid)) for c in listening
               if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed, exposed


def _describe(pid: int | None) -> str:
    import psutil

    try:
        process = psutil.Process(pid)
        return f"{pid} {process.name()} {' '.join(process.cmdline())[:200]} (parent {process.ppid()})"
    except psutil.Error:
        return f"{pid} (gone)"


@pytest.mark.parametrize(("address", "local"), [
    (None, True), ("", True), ("127.0.0.1:6379", True), ("localhost:10001", True), ("ray://127.0.0.1:10001", True),
    ("10.0.0.5:6379", False), ("head.cluster:6379", False), ("ray://10.0.0.5:10001", False),
])
def test_a_ray_address_on_loopback_keeps_this_processs_ray_endpoints_on_loopback(address: str | None,
                                                                                 local: bool) -> None:
    assert on_loopback(address) is local
