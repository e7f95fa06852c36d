"""`ServerConfig`: the whole server config file, with lookups by application kind and name."""

from __future__ import annotations

import difflib
from typing import TypeVar

from pydantic import Field, model_validator

from twinkle.config.apps import AnyApplication, Application, ModelApp, ProcessorApp, SamplerApp, ServerApp
from twinkle.config.base import StrictModel, config_problem
from twinkle.config.models import (
    AuthConfig,
    BrokerConfig,
    FlowerConfig,
    HttpOptions,
    PersistenceConfig,
    ProxyLocation,
    RayConfig,
    StorageConfig,
    TelemetryConfig,
)
from twinkle.config.tenancy import TenancyConfig, UsageConfig
from twinkle.errors import UserError

AppT = TypeVar("AppT", bound=Application)


class ServerConfig(StrictModel):
    """Everything `twinkle-server` needs to run: network, state, broker, access and the applications."""

    proxy_location: ProxyLocation = "EveryNode"
    """Accepted for compatibility with Ray Serve configs, no effect (check-config says so): the API runs where
    `twinkle-server launch` runs; for a proxy on every node run one `launch --only api` per node."""
    http_options: HttpOptions = Field(default_factory=HttpOptions)
    """Where the API listens."""
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    """OpenTelemetry export."""
    persistence: PersistenceConfig = Field(default_factory=PersistenceConfig)
    """Where durable server state lives."""
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    """The Redis/Valkey broker."""
    storage: StorageConfig = Field(default_factory=StorageConfig)
    """Checkpoint directory and payload retention."""
    auth: AuthConfig = Field(default_factory=AuthConfig)
    """API keys; none configured means development mode."""
    flower: FlowerConfig = Field(default_factory=FlowerConfig)
    """The Flower monitoring UI."""
    ray_namespace: str = Field(default="twinkle_cluster", min_length=1)
    """Ray namespace the server's actors live in (`launch --namespace` overrides it)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """How to reach Ray."""
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig)
    """Tiers of API keys: scheduling weights and quotas."""
    usage: UsageConfig = Field(default_factory=UsageConfig)
    """Usage metering and prices."""
    applications: list[AnyApplication] = Field(default_factory=list)
    """The components to deploy."""

    @model_validator(mode="after")
    def _applications_are_distinct(self) -> ServerConfig:
        numbered = list(enumerate(self.applications))
        _refuse_duplicates([(index, app.name) for index, app in numbered], "name")
        _refuse_duplicates([(index, app.route_prefix) for index, app in numbered], "route_prefix")
        servers = [index for index, app in numbered if isinstance(app, ServerApp)]
        if len(servers) > 1:
            raise config_problem(
                f"a second server application (the first is applications[{servers[0]}])",
                subpath=f"applications[{servers[1]}].import_path",
                hint="one server application serves every model; remove the extra one",
            )
        # Clients pick a pool by its served name, so two pools of one kind may not share it.
        models = [(index, app.args.served_name) for index, app in numbered if isinstance(app, ModelApp)]
        samplers = [(index, app.args.served_name) for index, app in numbered if isinstance(app, SamplerApp)]
        _refuse_duplicates(models, "args.served_model_name")
        _refuse_duplicates(samplers, "args.served_model_name")
        return self

    def model_apps(self) -> list[ModelApp]:
        """The model pools, in config order."""
        return self._apps_of(ModelApp)

    def sampler_apps(self) -> list[SamplerApp]:
        """The sampler pools, in config order."""
        return self._apps_of(SamplerApp)

    def processor_apps(self) -> list[ProcessorApp]:
        """The processor pools, in config order."""
        return self._apps_of(ProcessorApp)

    def server_app(self) -> ServerApp | None:
        """The central server application, if the config has one."""
        servers = self._apps_of(ServerApp)
        return servers[0] if servers else None

    def app(self, name: str) -> Application:
        """The application called `name`; a UserError naming the known ones when there is none."""
        for application in self.applications:
            if application.name == name:
                return application
        names = [application.name for application in self.applications]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known applications: {', '.join(names) or 'none'}"
        raise UserError(f"the config has no application named {name!r}", hint=hint)

    def _apps_of(self, kind: type[AppT]) -> list[AppT]:
        return [application for application in self.applications if isinstance(application, kind)]


def _refuse_duplicates(values: list[tuple[int, str]], field: str) -> None:
    """Raise for the first application whose value an earlier one already has."""
    seen: dict[str, int] = {}
    for index, value in values:
        if value in seen:
            raise config_problem(
                f"{value!r} is already used by applications[{seen[value]}]",
                subpath=f"applications[{index}].{field}",
                hint=f"give every application its own {field.rsplit('.', 1)[-1]}",
            )
        seen[value] = index
