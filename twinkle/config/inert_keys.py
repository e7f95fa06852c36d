"""Keys a config sets that Twinkle accepts for compatibility with the seed's Ray Serve configs but that have no
effect here, each named with the reason, so that `check-config` and `launch` can say so instead of ignoring them.

Only keys the file sets are named (pydantic's `model_fields_set`): a default has no author to mislead. What a
key does where it does mean something is honoured elsewhere (`ray_actor_options` on Ray device groups,
`max_ongoing_requests` on sampler pools, `metrics_update_interval` on the server gauges); this module names the
cases left over.
"""

from __future__ import annotations

from pydantic import BaseModel

from twinkle.config.apps import Application, ModelApp, SamplerApp
from twinkle.config.parallelism import needs_ray
from twinkle.config.server_config import ServerConfig

NO_EFFECT = "accepted for compatibility, no effect"


def _set(model: BaseModel, field: str) -> bool:
    return field in model.model_fields_set


def inert_keys(config: ServerConfig) -> list[str]:
    """One line per set key that changes nothing: `path: accepted for compatibility, no effect: why`."""
    notes: list[str] = []
    if _set(config, "proxy_location"):
        notes.append(f"proxy_location: {NO_EFFECT}: the API runs where `twinkle-server launch` (or `launch --only "
                     "api`) runs; for a proxy on every node run one `--only api` per node behind a load balancer")
    for index, app in enumerate(config.applications):
        notes += _app_notes(config, app, f"applications[{index}]")
    return notes


def _app_notes(config: ServerConfig, app: Application, where: str) -> list[str]:
    notes: list[str] = []
    args = app.args
    settings = getattr(args, "server_config", None)
    if settings is not None and _set(settings, "cleanup_interval"):
        notes.append(f"{where}.args.server_config.cleanup_interval: {NO_EFFECT}: sessions and futures expire by "
                     "their Redis time-to-live, and pools check their adapters every second")
    for d_index, deployment in enumerate(app.deployments):
        at = f"{where}.deployments[{d_index}]"
        scaling = deployment.autoscaling_config
        if _set(scaling, "max_replicas") and scaling.max_replicas > scaling.min_replicas:
            notes.append(f"{at}.autoscaling_config.max_replicas: {NO_EFFECT}: Twinkle runs min_replicas "
                         f"({scaling.min_replicas}) replicas and does not autoscale")
        if _set(scaling, "target_ongoing_requests"):
            notes.append(f"{at}.autoscaling_config.target_ongoing_requests: {NO_EFFECT}: Twinkle does not "
                         "autoscale; the replica count is min_replicas")
        if _set(deployment, "max_ongoing_requests") and not isinstance(app, SamplerApp):
            notes.append(f"{at}.max_ongoing_requests: {NO_EFFECT} on a {app.import_path} application: "
                         + _ongoing_reason(app.import_path))
        options = deployment.ray_actor_options
        if options.model_fields_set and not (isinstance(app, ModelApp) and needs_ray(config, app.args)):
            notes.append(f"{at}.ray_actor_options: {NO_EFFECT} here: this {app.import_path} application runs "
                         "in its own process, not in Ray actors (only model pools on a Ray device group use them)")
        env = deployment.runtime_env
        if _set(env, "pip"):
            notes.append(f"{at}.runtime_env.pip: {NO_EFFECT}: install the packages into the server's "
                         "environment on every node")
        if _set(env, "working_dir"):
            notes.append(f"{at}.runtime_env.working_dir: {NO_EFFECT}: processes run in the directory "
                         "`twinkle-server launch` was started from")
    return notes


def _ongoing_reason(kind: str) -> str:
    if kind == "model":
        return ("a model pool runs its ops in per-adapter order; args.scheduling.window sets how many it holds "
                "and args.clock.max_ops how many one fused pass takes")
    if kind == "processor":
        return "args.ncpu_proc_per_node sets how many requests a processor pool runs at once"
    return "limit clients with the rate limits in auth and the quotas in tenancy"
