"""Which parallel layouts each model backend can run, checked when the config is loaded.

`transformers` and `mock` train data parallel only: every rank holds a whole model replica and the batch
is split across ranks (gradients all-reduced). Splitting one model over several devices (tensor, pipeline,
expert, context parallelism) needs a backend that shards the model, which today is only `megatron`, and
only along the tensor dimension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinkle.config.devices import DeviceMesh

if TYPE_CHECKING:
    from twinkle.config.args import ModelArgs
    from twinkle.config.server_config import ServerConfig

# backend -> the mesh dimensions (besides dp) it can split the model along
SHARDED_DIMENSIONS: dict[str, frozenset[str]] = {
    "transformers": frozenset(),
    "mock": frozenset(),
    "megatron": frozenset({"tp"}),
}

_WHY_NOT: dict[str, str] = {
    "transformers": "the transformers backend keeps a whole model copy on every rank and trains data "
    "parallel only (dp_size)",
    "mock": "the mock backend is a single numpy model and trains data parallel only (dp_size)",
    "megatron": "the megatron backend drives tensor parallelism (tp_size) and data parallelism only; "
    "pipeline, expert and context parallelism are not wired up",
}

_NAMES = {"tp": "tensor", "pp": "pipeline", "ep": "expert", "cp": "context"}


def parallelism_problems(backend: str, mesh: DeviceMesh) -> list[str]:
    """Why `backend` cannot run `mesh`, one entry per refused dimension (empty when it can)."""
    supported = SHARDED_DIMENSIONS.get(backend, frozenset())
    problems = []
    for dim, name in _NAMES.items():
        size = int(getattr(mesh, f"{dim}_size"))
        if size > 1 and dim not in supported:
            reason = _WHY_NOT.get(backend, f"backend {backend!r} supports no {name} parallelism")
            problems.append(f"{dim}_size={size} ({name} parallel): {reason}")
    return problems


def device_group_size(mesh: DeviceMesh) -> int:
    """How many ranks (Ray actors) a model pool with this mesh runs: one per rank of the mesh. (On cuda
    the config insists that this equals device_group.ranks; for cpu pools the seed reads `ranks` as a CPU
    index.)"""
    return mesh.world_size


def needs_ray(config: ServerConfig, args: ModelArgs) -> bool:
    """A model pool runs on a Ray device group when it spans several ranks or the config names a Ray
    cluster; otherwise it stays in its worker process and Ray is never started."""
    return device_group_size(args.device_mesh) > 1 or bool(config.ray.address)
