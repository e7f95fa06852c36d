"""Applications: the components a server deploys. `import_path` picks the kind and the shape of `args`."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from twinkle.config.args import ModelArgs, ProcessorArgs, SamplerArgs, ServerArgs
from twinkle.config.base import StrictModel, config_problem
from twinkle.config.deployment import Deployment

AppKind = Literal["server", "model", "sampler", "processor"]
APP_KINDS: tuple[AppKind, ...] = ("server", "model", "sampler", "processor")

# Application names become queue names (`model.<name>.<replica>`) and Ray actor names.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class Application(StrictModel):
    """One component of the server. Parse configs with `parse_config`, which picks the subclass
    (ServerApp, ModelApp, SamplerApp, ProcessorApp) from `import_path`."""

    name: str
    """Unique name of the application (letters, digits, `.`, `_`, `-`); `--only worker NAME` uses it."""
    route_prefix: str
    """URL prefix the application's HTTP routes live under, e.g. `/api/v1/model/Qwen/Qwen3.5-4B`."""
    import_path: AppKind
    """Kind of component: `server`, `model`, `sampler` or `processor`; it decides what `args` holds."""
    args: ServerArgs | ModelArgs | SamplerArgs | ProcessorArgs
    """Arguments of the component, validated according to `import_path`."""
    deployments: list[Deployment] = Field(default_factory=list)
    """Replica count and per-replica resources."""

    @field_validator("name")
    @classmethod
    def _usable_as_queue_name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise config_problem(
                f"{name!r} is not a valid application name",
                hint="start with a letter or digit and use only letters, digits, '.', '_' and '-'",
            )
        return name

    @field_validator("route_prefix")
    @classmethod
    def _absolute_prefix(cls, prefix: str) -> str:
        if not prefix.startswith("/"):
            raise config_problem("must start with '/'", hint=f"write '/{prefix}'")
        return prefix.rstrip("/") or "/"


class ServerApp(Application):
    """The central API server: sessions, training runs, checkpoints, capabilities."""

    import_path: Literal["server"]
    """Always `server`."""
    args: ServerArgs = Field(default_factory=ServerArgs)
    """Server limits and the advertised models."""


class ModelApp(Application):
    """A model pool: one base model, many LoRA adapters trained on it."""

    import_path: Literal["model"]
    """Always `model`."""
    args: ModelArgs
    """The base model, its backend, devices and limits."""


class SamplerApp(Application):
    """A sampler pool: generation with the base model and LoRA adapters."""

    import_path: Literal["sampler"]
    """Always `sampler`."""
    args: SamplerArgs
    """The base model, the inference engine, devices and limits."""


class ProcessorApp(Application):
    """The processor pool: tokenization and chat templates on CPU."""

    import_path: Literal["processor"]
    """Always `processor`."""
    args: ProcessorArgs = Field(default_factory=ProcessorArgs)
    """Process count, devices and limits."""


AnyApplication = Annotated[
    ServerApp | ModelApp | SamplerApp | ProcessorApp, Field(discriminator="import_path")
]
"""An application of any kind; validation dispatches on `import_path`."""
