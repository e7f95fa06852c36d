"""Which pools serve which base model, derived once from the config.

Clients name base models as they know them (`Qwen/Qwen3.5-4B`); the config names them by where they
load from (`ms://Qwen/Qwen3.5-4B`, a local directory). A served model answers to its configured
`served_model_name`, its model_id, the model_id without scheme, and a local directory's basename.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twinkle.errors import InvalidRequest

if TYPE_CHECKING:
    from twinkle.config.apps import ModelApp
    from twinkle.config.server_config import ServerConfig


def model_queue(app: str, replica: int = 0) -> str:
    return f"model.{app}.{replica}"


def sampler_queue(app: str) -> str:
    return f"sampler.{app}"


def processor_queue(app: str) -> str:
    return f"processor.{app}"


def strip_scheme(model_id: str) -> str:
    for scheme in ("ms://", "hf://"):
        if model_id.startswith(scheme):
            return model_id[len(scheme) :]
    return model_id


def served_name(model_id: str, explicit: str | None = None) -> str:
    if explicit:
        return explicit
    plain = strip_scheme(model_id)
    if os.path.isdir(os.path.expanduser(plain)):
        return os.path.basename(os.path.normpath(plain))
    return plain


@dataclass
class ServedModel:
    name: str
    model_id: str
    aliases: set[str] = field(default_factory=set)
    model_app: str | None = None
    model_queues: list[str] = field(default_factory=list)
    sampler_app: str | None = None
    sampler_queue: str | None = None
    max_length: int | None = None
    backend: str = ""
    max_loras: int = 0  # LoRA slots per model replica
    full_runs: str = ""  # "" = no full-parameter runs; else what other runs' ops do meanwhile: "wait" | "refuse"

    @property
    def trainable(self) -> bool:
        return self.model_app is not None

    def sample_queue(self) -> str | None:
        return self.sampler_queue or (self.model_queues[0] if self.model_queues else None)


class Catalog:
    def __init__(self, config: ServerConfig) -> None:
        self.models: dict[str, ServedModel] = {}
        # pool queue -> the window fair share divides among keys (twinkle.backlog); absent: no backlogs
        self.backlog_windows: dict[str, int] = {}
        # pool queue -> "wait" | "refuse": pools a full-parameter run may hold exclusively (twinkle.pool_reservation)
        self.reserving_queues: dict[str, str] = {}
        for app in config.model_apps():
            served = self._entry(app.args.model_id, getattr(app.args, "served_model_name", None))
            served.model_app = app.name
            replicas = max(1, _replicas(app))
            served.model_queues = [model_queue(app.name, i) for i in range(replicas)]
            served.max_length = app.args.max_length
            served.backend = app.args.backend
            served.max_loras = app.args.adapter_config.max_loras
            if app.args.full_finetune.enabled:
                served.full_runs = app.args.full_finetune.while_reserved
                self.reserving_queues.update(dict.fromkeys(served.model_queues, served.full_runs))
            if app.args.scheduling.policy == "fair":
                self.backlog_windows.update(dict.fromkeys(served.model_queues, app.args.scheduling.window))
        for sampler in config.sampler_apps():
            served = self._entry(sampler.args.model_id, getattr(sampler.args, "served_model_name", None))
            served.sampler_app = sampler.name
            served.sampler_queue = sampler_queue(sampler.name)
            if sampler.args.scheduling.policy == "fair":
                self.backlog_windows[served.sampler_queue] = sampler.args.scheduling.window

    def _entry(self, model_id: str, explicit: str | None) -> ServedModel:
        name = served_name(model_id, explicit)
        if name not in self.models:
            self.models[name] = ServedModel(name=name, model_id=model_id)
        served = self.models[name]
        served.aliases |= {name, model_id, strip_scheme(model_id), os.path.basename(strip_scheme(model_id))}
        return served

    def find(self, base_model: str) -> ServedModel:
        for served in self.models.values():
            if base_model in served.aliases:
                return served
        names = ", ".join(sorted(self.models)) or "(none)"
        raise InvalidRequest(f"Base model {base_model!r} is not served here.", hint=f"Served models: {names}.")

    def slots(self, queue: str) -> int:
        """The LoRA slots of the model replica behind `queue` (0: not a model queue)."""
        return next((m.max_loras for m in self.models.values() if queue in m.model_queues), 0)

    def by_app(self, app_name: str) -> ServedModel | None:
        return next((m for m in self.models.values() if app_name in (m.model_app, m.sampler_app)), None)


def _replicas(app: ModelApp) -> int:
    for deployment in app.deployments or []:
        scaling = getattr(deployment, "autoscaling_config", None)
        if scaling is not None:
            return int(getattr(scaling, "min_replicas", 1) or 1)
    return 1
