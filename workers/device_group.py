"""A model pool's Ray device group: a placement group of one bundle per rank, one actor per bundle.

The pool's worker process (its single Celery consumer) is the Ray driver. It reserves a placement group
of N bundles (`{"CPU": 1, "GPU": 1}` per rank for cuda, `{"CPU": 1}` for cpu), starts one
`RankReplica` actor pinned to each bundle (Ray sets CUDA_VISIBLE_DEVICES, so each rank sees one GPU),
lets the ranks form a torch.distributed group, and drives them through `DataParallelBackend`.

Ray comes up only here, i.e. only for pools that need it. Without `ray.address` the worker starts a
private local Ray instance on loopback (no dashboard, token auth off); with it, the worker joins that
cluster as a driver (multi-node: `ray start --head` on one node, `ray start --address` on the others).

A rank actor that dies takes the pool down with it: each actor runs a `lifeline` call that never returns,
and a watcher thread exits the worker with `PoolExit.RANK_DIED` as soon as one of them fails. The
launcher restores the queue's unacked messages and restarts the worker, which builds a fresh group.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from twinkle.backends.data_parallel import DataParallelBackend, RankZeroSampler
from twinkle.config.deployment import RayActorOptions
from twinkle.config.parallelism import device_group_size
from twinkle.errors import TwinkleError
from twinkle.pool_exit import PoolExit
from twinkle.types import ModelInfo
from workers.factory import on_loopback
from workers.rank_replica import RankReplica

if TYPE_CHECKING:
    from twinkle.config.apps import ModelApp
    from twinkle.config.args import ModelArgs
    from twinkle.config.server_config import ServerConfig

log = logging.getLogger("twinkle.device_group")
PLACEMENT_TIMEOUT_SECONDS = float(os.environ.get("TWINKLE_PLACEMENT_TIMEOUT", "300"))
# After one rank failed an op, how long the others may take to finish theirs; longer means they are stuck
# in a collective the failed rank never joined, and the group is restarted.
RANK_SETTLE_SECONDS = 60.0


def connect(config: ServerConfig, *, local_cpus: int) -> None:
    """Join the configured Ray cluster, or start a private one on loopback for this process."""
    if ray.is_initialized():
        return
    namespace = os.environ.get("TWINKLE_RAY_NAMESPACE") or config.ray_namespace
    if config.ray.address:
        # joining a cluster on loopback: this driver's endpoints stay on loopback too
        node_ip = "127.0.0.1" if on_loopback(config.ray.address) else None
        ray.init(address=config.ray.address, namespace=namespace, log_to_driver=True, _node_ip_address=node_ip)
        log.info("joined the Ray cluster at %s (namespace %s)", config.ray.address, namespace)
        return
    # loopback only (with workers.factory.PRIVATE_RAY_ENV, set before Ray was imported)
    # address="local": a new instance even where a `ray start` cluster of this machine is running
    ray.init(address="local", num_cpus=max(local_cpus, os.cpu_count() or 1), include_dashboard=False,
             namespace=namespace,
             _node_ip_address="127.0.0.1", log_to_driver=True)
    log.info("started a local Ray instance for this pool (%d CPUs)", max(local_cpus, os.cpu_count() or 1))


def bundle_for(device_type: str, actor_options: RayActorOptions | None = None) -> dict[str, float]:
    """What each rank reserves: one CPU and one device of its type, unless the deployment's
    `ray_actor_options` say otherwise (more CPUs for data loading, a GPU fraction, memory, or a custom resource
    that pins the ranks to the nodes offering it)."""
    bundle: dict[str, float] = {"CPU": 1}
    if device_type == "cuda":
        bundle["GPU"] = 1
    elif device_type == "npu":
        bundle["NPU"] = 1
    if actor_options is None:
        return bundle
    if actor_options.num_cpus is not None:
        bundle["CPU"] = actor_options.num_cpus
    if actor_options.num_gpus is not None and device_type == "cuda":
        bundle["GPU"] = actor_options.num_gpus
    if actor_options.memory is not None:
        bundle["memory"] = actor_options.memory
    bundle.update(actor_options.resources)
    return {name: amount for name, amount in bundle.items() if amount > 0}


def actor_options_for(bundle: dict[str, float]) -> dict[str, Any]:
    """The rank actor's own reservation: all of its bundle (Ray's names for the built-in resources)."""
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    if "memory" in bundle:
        options["memory"] = bundle["memory"]
    custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


def rank_actor_options(app: ModelApp) -> RayActorOptions | None:
    """The first deployment's `ray_actor_options`, where the config sets any."""
    for deployment in app.deployments or []:
        if deployment.ray_actor_options.model_fields_set:
            return deployment.ray_actor_options  # type: ignore[no-any-return]
    return None


def placement_strategy(ranks: int, nproc_per_node: int) -> str:
    """All ranks on one node when nproc_per_node covers them, otherwise as few nodes as possible."""
    return "STRICT_PACK" if nproc_per_node >= ranks else "PACK"


@ray.remote(concurrency_groups={"lifeline": 1})  # type: ignore[call-overload]
class RankActor(RankReplica):
    @ray.method(concurrency_group="lifeline")
    def lifeline(self) -> None:
        """Never returns: the caller learns that this actor died when the call fails."""
        threading.Event().wait()


class RayDeviceGroup:
    """Implements `twinkle.backends.data_parallel.RankGroup` with one Ray actor per rank."""

    def __init__(self, actors: list[Any], pg: PlacementGroup, on_death: Callable[[str], None]) -> None:
        self.actors = actors
        self.pg = pg
        self.on_death = on_death
        self.info: ModelInfo | None = None
        self.spmd = False
        self._closing = threading.Event()

    @property
    def size(self) -> int:
        return len(self.actors)

    @classmethod
    def start(cls, args: ModelArgs, label: str, env_vars: dict[str, str],
              on_death: Callable[[str], None], actor_options: RayActorOptions | None = None) -> RayDeviceGroup:
        ranks = device_group_size(args.device_mesh)
        device_type = args.device_group.device_type
        bundle = bundle_for(device_type, actor_options)
        strategy = placement_strategy(ranks, args.nproc_per_node)
        pg = placement_group([dict(bundle) for _ in range(ranks)], strategy=strategy,
                             name=f"twinkle-{label}-{os.getpid()}")
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_SECONDS)
        except GetTimeoutError:
            raise RuntimeError(
                f"Ray could not reserve {ranks} x {bundle} ({strategy}) for {label} within "
                f"{PLACEMENT_TIMEOUT_SECONDS:g} s; the cluster has {ray.available_resources()} free. "
                "Add nodes (ray start --address ...) or lower device_group.ranks.") from None
        options = actor_options_for(bundle)
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        actors = [
            RankActor.options(  # type: ignore[attr-defined]
                name=f"twinkle-{label}-{os.getpid()}-rank{rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=rank),
                **options,
            ).remote(args, rank, ranks)
            for rank in range(ranks)
        ]
        group = cls(actors, pg, on_death)
        master_addr, master_port = ray.get(actors[0].rendezvous.remote())
        started = ray.get([actor.start.remote(master_addr, master_port) for actor in actors])
        group.info, group.spmd = started[0]
        pids = ray.get([actor.pid.remote() for actor in actors])
        log.info("device group %s: %d ranks (%s, %s), pids %s", label, ranks, device_type, strategy, pids)
        group.watch()
        return group

    def pids(self) -> list[int]:
        return list(ray.get([actor.pid.remote() for actor in self.actors]))

    def call(self, rank: int, method: str, *args: Any) -> Any:
        return self._gather([getattr(self.actors[rank], method).remote(*args)])[0]

    def call_all(self, method: str, args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        pairs = zip(self.actors, args_per_rank, strict=True)
        refs = [getattr(actor, method).remote(*args) for actor, args in pairs]
        return self._gather(refs)

    def _gather(self, refs: list[Any]) -> list[Any]:
        try:
            return list(ray.get(refs))
        except RayActorError as exc:
            self.on_death(f"a rank actor died: {exc}")
            raise
        except RayTaskError as exc:
            self._settle(refs)
            cause = exc.cause
            if isinstance(cause, TwinkleError):
                raise cause from None  # the ranks' typed errors reach the client as if raised here
            raise

    def _settle(self, refs: list[Any]) -> None:
        """Wait for the ranks that did not fail; ranks still busy long after are stuck in a collective."""
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=RANK_SETTLE_SECONDS)
        if pending:
            self.on_death(f"{len(pending)} rank(s) still busy {RANK_SETTLE_SECONDS:g} s after another failed")

    def close(self) -> None:
        """Stop the ranks and free their bundles (without reporting it as a death)."""
        self._closing.set()
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)

    def watch(self) -> None:
        lifelines = [actor.lifeline.remote() for actor in self.actors]
        atexit.register(self._closing.set)  # registered after ray.init, so it runs before Ray's own shutdown

        def run() -> None:
            ready, _ = ray.wait(lifelines, num_returns=1)
            if self._closing.is_set():
                return
            rank = lifelines.index(ready[0])
            try:
                ray.get(ready[0])
                reason = f"rank {rank} left its lifeline"
            except Exception as exc:  # noqa: BLE001 - any failure of a lifeline means the actor is gone
                reason = f"rank {rank} died ({type(exc).__name__})"
            self.on_death(reason)

        threading.Thread(target=run, name="rank-lifelines", daemon=True).start()


def exit_for_rank_death(reason: str) -> None:
    """The pool cannot continue with a partial group: exit now so the launcher restarts it."""
    log.error("device group broken: %s; exiting with code %d for a restart", reason, PoolExit.RANK_DIED)
    logging.shutdown()
    os._exit(PoolExit.RANK_DIED)


def start_device_group(config: ServerConfig, app: ModelApp, label: str,
                       on_death: Callable[[str], None] = exit_for_rank_death) -> tuple[DataParallelBackend,
                                                                                          RankZeroSampler]:
    """The pool's backend and checkpoint sampler on a fresh Ray device group."""
    args = app.args
    started = time.perf_counter()
    connect(config, local_cpus=device_group_size(args.device_mesh))
    group = RayDeviceGroup.start(args, label, _actor_env(app), on_death, rank_actor_options(app))
    assert group.info is not None
    backend = DataParallelBackend(group, dp_size=args.device_mesh.dp_size, info=group.info, spmd=group.spmd)
    log.info("device group %s ready in %.1f s", label, time.perf_counter() - started)
    return backend, RankZeroSampler(group, group.info)


def _actor_env(app: ModelApp) -> dict[str, str]:
    """What rank actors need from the pool's environment: the app's runtime_env and Twinkle's settings
    (on a joined cluster actors do not inherit the worker's environment)."""
    env = {key: value for key, value in os.environ.items() if key.startswith("TWINKLE_")}
    for deployment in app.deployments or []:
        env.update({k: str(v) for k, v in (deployment.runtime_env.env_vars or {}).items()})
    return env
