"""Which replicas of a pool a launch starts: all of them, or those `launch --only worker NAME --replica I ...` names,
so that one pool's replicas can run on different nodes (each replica consumes its own queue)."""

from __future__ import annotations

from collections.abc import Sequence

from twinkle.config.apps import Application, ModelApp


def replica_count(app: Application) -> int:
    """How many replicas the pool runs: a model app's `min_replicas` (Twinkle does not autoscale); others one."""
    if not isinstance(app, ModelApp):
        return 1
    for deployment in app.deployments or []:
        if deployment.autoscaling_config is not None:
            return max(1, int(deployment.autoscaling_config.min_replicas or 1))
    return 1


def chosen(app: Application, replicas: Sequence[int] | None) -> list[int]:
    """The replicas of `app` to start: `replicas` (validated by `problem`), or all of them when None."""
    return sorted(set(replicas)) if replicas else list(range(replica_count(app)))


def problem(app: Application, replicas: Sequence[int]) -> str | None:
    """Why `replicas` cannot be started for `app`, or None."""
    count = replica_count(app)
    wrong = sorted({i for i in replicas if not 0 <= i < count})
    if not wrong:
        return None
    have = f"replicas 0 to {count - 1}" if count > 1 else "one replica, 0"
    return (f"{app.name} has no replica {', '.join(map(str, wrong))}: it runs {have} "
            "(autoscaling_config.min_replicas of a model application sets how many)")
