"""Build a pool's backend or sampler from its application args."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from twinkle.backends import BACKENDS, DEFAULT_SAMPLER_FOR_BACKEND, SAMPLERS, resolve
from twinkle.backends.paging import MIB, PagingBudget
from twinkle.catalog import strip_scheme
from twinkle.config.parallelism import needs_ray

if TYPE_CHECKING:
    from twinkle.config.apps import ModelApp
    from twinkle.config.args import ModelArgs
    from twinkle.config.server_config import ServerConfig

MOCK_DEFAULT_VOCAB = 32000
# A private Ray instance for one pool: no token auth (a stale ~/.ray token would switch it on), and
# 127.0.0.1 kept as the node address instead of being replaced by eth0's (Ray reads this at import).
PRIVATE_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _mock_source(model_id: str) -> str | int:
    """The mock backend reads the vocabulary of a local model directory; hub ids get a fixed size."""
    path = os.path.expanduser(strip_scheme(model_id))
    return path if os.path.isdir(path) else MOCK_DEFAULT_VOCAB


def build_model_backend(args: ModelArgs, sampler_factory: Any = None) -> Any:
    cls = resolve(BACKENDS, args.backend, "backend")
    max_loras = args.adapter_config.max_loras
    if args.backend == "mock":
        return cls(_mock_source(args.model_id), max_loras=max_loras, max_length=args.max_length,
                   paging=paging_budget(args.adapter_config))
    if args.backend == "megatron":  # no paging yet: max_loras is a hard limit there
        return cls(args.model_id, torch_dtype=args.torch_dtype, max_loras=max_loras, max_length=args.max_length,
                   device_mesh=args.device_mesh, sampler_factory=sampler_factory)
    return cls(args.model_id, torch_dtype=args.torch_dtype, max_loras=max_loras, max_length=args.max_length,
               paging=paging_budget(args.adapter_config), max_shard_size=args.full_finetune.max_shard_size)


def paging_budget(adapters: Any) -> PagingBudget:
    """Where adapters beyond the LoRA slots go (backends.paging)."""
    return PagingBudget(host_bytes=adapters.page_host_mb * MIB, disk_bytes=adapters.page_disk_mb * MIB,
                        directory=adapters.page_dir)


def build_model_pool(config: ServerConfig, app: ModelApp, replica: int) -> tuple[Any, Any]:
    """A model pool's backend and checkpoint sampler: in this process, or on a Ray device group when the
    pool spans several ranks or the config names a Ray cluster."""
    if needs_ray(config, app.args):
        if on_loopback(config.ray.address):  # a private cluster, or one on this machine's loopback
            for key, value in PRIVATE_RAY_ENV.items():
                os.environ.setdefault(key, value)
        from workers.device_group import start_device_group  # deferred: imports Ray, which reads the env

        return start_device_group(config, app, f"{app.name}.{replica}")
    return build_backend_and_sampler(app.args)


def on_loopback(address: str | None) -> bool:
    """True for no address (Ray started here) or one on 127.0.0.1/localhost: this process's own Ray
    endpoints should then listen on loopback too, not on the machine's network address."""
    host = (address or "127.0.0.1").removeprefix("ray://").rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "::1", "[::1]")


def build_backend_and_sampler(args: ModelArgs) -> tuple[Any, Any]:
    """One backend replica and the sampler it serves sampler checkpoints with."""
    holder: dict[str, Any] = {}  # megatron samples in memory through the pool's sampler, built next
    backend = build_model_backend(args, sampler_factory=lambda: holder["sampler"])
    sampler = holder["sampler"] = build_pool_sampler(args, backend)
    return backend, sampler


def build_sampler(model_id: str, sampler_type: str, *, max_loras: int = 4, torch_dtype: str = "auto",
                  engine_args: dict[str, Any] | None = None) -> Any:
    cls = resolve(SAMPLERS, sampler_type, "sampler_type")
    if sampler_type == "mock":
        return cls(_mock_source(model_id))
    if sampler_type == "vllm":
        return cls(model_id, engine_args=engine_args or {}, max_loras=max_loras)
    return cls(model_id, max_loras=max_loras, torch_dtype=torch_dtype)


def build_pool_sampler(args: ModelArgs, backend: Any) -> Any:
    """The sampler a model pool uses for sampler checkpoints; shares the backend's model when it can."""
    sampler_type = sampler_type_for_model_pool(args)
    if sampler_type == "torch" and args.backend == "transformers":
        from twinkle.samplers.torch_sampler import TorchSampler

        return TorchSampler.sharing(backend, max_loras=args.adapter_config.max_loras)
    return build_sampler(args.model_id, sampler_type, max_loras=args.adapter_config.max_loras,
                         torch_dtype=args.torch_dtype)


def sampler_type_for_model_pool(args: ModelArgs) -> str:
    return args.sampler_type or DEFAULT_SAMPLER_FOR_BACKEND.get(args.backend, "torch")
