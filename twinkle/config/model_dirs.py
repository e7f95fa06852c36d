"""Model directories a config names that are not on this machine, found before anything starts.

A model_id is a hub id (`ms://org/name`, `hf://org/name`, or a plain `org/name` that is no local directory),
a local directory, or for the mock backend a vocabulary size. A local path that does not exist would load
nowhere: `check-config` reports it and `launch` refuses, instead of a pool that fails at every start.
Relative paths start from the directory the command runs in, as the pools resolve them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.config.apps import ModelApp, SamplerApp
from twinkle.config.args import ModelArgs, SamplerArgs
from twinkle.config.problems import Problem

if TYPE_CHECKING:
    from twinkle.config.server_config import ServerConfig

_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def model_dir_problems(config: ServerConfig, only_name: str | None = None) -> list[Problem]:
    """One problem per model or sampler application whose model directory is missing or is no model."""
    problems = []
    for index, app in enumerate(config.applications):
        if not isinstance(app, ModelApp | SamplerApp) or only_name not in (None, app.name):
            continue
        problem = _problem(str(app.args.model_id), is_mock(app.args))
        if problem is not None:
            message, hint = problem
            problems.append(Problem(f"applications[{index}].args.model_id", message, hint))
    return problems


def is_mock(args: ModelArgs | SamplerArgs) -> bool:
    """Whether the pool serves the mock backend, whose model ids need no directory."""
    return "mock" in ((args.backend, args.sampler_type) if isinstance(args, ModelArgs) else (args.sampler_type,))


def _problem(model_id: str, mock: bool) -> tuple[str, str] | None:
    if "://" in model_id or (mock and model_id.isdigit()):
        return None  # a hub id, or the mock's vocabulary size
    local = Path(model_id).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return None
        return (f"{model_id!r} is a directory without config.json, so no HuggingFace model",
                "point it at the directory that holds the model's config.json and weights")
    hub_like = model_id.count("/") == 1 and not model_id.startswith(_LOCAL_PREFIXES)
    if hub_like and not mock:
        return None  # a hub id such as Qwen/Qwen3-0.6B, downloaded at start
    return (f"no model directory at {model_id!r} (looked in {local.absolute()})",
            f"build the tiny test model there with `twinkle-server build-tiny-model {model_id}`, set model_id "
            "(TWINKLE_MODEL_DIR in the cookbook configs) to a model directory, or use a hub id such as "
            "ms://Qwen/Qwen3.5-4B; relative paths start from the directory you run twinkle-server in")
