"""What this machine lacks to run a config's pools, checked without importing the heavy packages."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from twinkle.config.apps import ModelApp, SamplerApp
from twinkle.config.parallelism import needs_ray

if TYPE_CHECKING:
    from twinkle.config.server_config import ServerConfig


def runtime_problems(config: ServerConfig, only_name: str | None = None) -> list[str]:
    from twinkle.backends.megatron.requirements import megatron_requirements_problem
    from twinkle.samplers.vllm_sampler import vllm_requirements_problem

    wanted = [app for app in (*config.model_apps(), *config.sampler_apps()) if only_name in (None, app.name)]
    problems = []
    for app in wanted:
        if isinstance(app, ModelApp) and app.args.backend == "megatron":
            problem = megatron_requirements_problem()
        elif isinstance(app, SamplerApp) and app.args.sampler_type == "vllm":
            problem = vllm_requirements_problem()
        else:
            problem = None
        if problem is not None:
            problems.append(f"{app.name}: {problem}")
        if isinstance(app, ModelApp) and needs_ray(config, app.args) and importlib.util.find_spec("ray") is None:
            problems.append(f"{app.name}: its device group needs Ray, which is not installed "
                            "(pip install 'twinkle[ray]')")
    return problems
