"""How many replicas of an application run and what each one asks of the cluster."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from twinkle.config.base import StrictModel, config_problem


def _number_to_str(value: Any) -> Any:
    # YAML reads `TWINKLE_TRUST_REMOTE_CODE: 0` as an int; environment values are strings anyway.
    # Booleans are left alone so `true` fails loudly instead of silently becoming "True".
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


EnvValue = Annotated[str, BeforeValidator(_number_to_str)]


class AutoscalingConfig(StrictModel):
    """Replica count of a deployment."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas kept running."""
    max_replicas: int = Field(default=1, ge=1)
    """No effect beyond min_replicas (Twinkle does not autoscale; check-config says so)."""
    target_ongoing_requests: float | None = Field(default=None, gt=0)
    """No effect (Twinkle does not autoscale; check-config says so); accepted for compatibility."""

    @model_validator(mode="after")
    def _min_not_above_max(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise config_problem(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})",
                subpath="min_replicas",
            )
        return self


class RayActorOptions(StrictModel):
    """Resources each rank of a model pool on a Ray device group reserves in Ray (its placement bundle)."""

    num_cpus: float | None = Field(default=None, ge=0)
    """CPUs reserved per replica."""
    num_gpus: float | None = Field(default=None, ge=0)
    """GPUs reserved per replica (fractions allowed)."""
    memory: float | None = Field(default=None, ge=0)
    """Memory reserved per replica, in bytes."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources reserved per replica, by name."""


class RuntimeEnv(StrictModel):
    """The process environment of each replica."""

    env_vars: dict[str, EnvValue] = Field(default_factory=dict)
    """Environment variables set in the replica's processes."""
    pip: list[str] | None = None
    """No effect (check-config says so): install packages into the server's environment on every node."""
    working_dir: str | None = None
    """No effect (check-config says so): processes run where `twinkle-server launch` was started."""


class Deployment(StrictModel):
    """Scaling and resources of one deployment of an application."""

    name: str
    """Name of the deployment, shown in logs and Ray."""
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    """Requests one replica handles at once: a sampler pool's batch size unless engine_args.max_num_seqs sets
    it; no effect on other applications (check-config says so)."""
    autoscaling_config: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    """Replica count."""
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)
    """What each rank of a model pool on a Ray device group reserves; no effect on applications that run in
    their own process (check-config says so)."""
    runtime_env: RuntimeEnv = Field(default_factory=RuntimeEnv)
    """Environment of each replica."""
