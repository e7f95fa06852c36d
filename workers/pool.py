"""A pool worker process: load the backend once, then consume the pool's queue forever.

`python -m workers --config cfg.yaml --app NAME [--replica N]` is what the launcher runs per pool.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any, NoReturn

import redis
from celery.signals import task_received
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from twinkle import launched_process, liveness
from twinkle.backends.base import ComputeDtype, SharedBase
from twinkle.backlog import BacklogRelease
from twinkle.catalog import model_queue, processor_queue, sampler_queue
from twinkle.celery_app import make_celery, task_name
from twinkle.checkpoints import CheckpointStore
from twinkle.config import Application, ModelApp, ProcessorApp, SamplerApp, ServerConfig, load_config
from twinkle.config.clock import SchedulingConfig
from twinkle.config.full_finetune import FullFinetuneConfig
from twinkle.errors import PoolLeaseHeld
from twinkle.futures import Op
from twinkle.keys import Keys
from twinkle.pool_exit import PoolExit
from twinkle.pool_lease import PoolLease, client_for
from twinkle.pool_reservation import PoolReservation
from twinkle.task_message import task_message
from twinkle.telemetry import op_span, setup_worker_telemetry
from twinkle.types import ModelInfo
from twinkle.usage import UsageLedger
from workers import broker_link, handover, processor
from workers.exports import ExportSettings
from workers.factory import build_model_pool, build_sampler
from workers.fair_turns import FairTurns
from workers.handlers import ModelPoolHandlers, SamplerPoolHandlers
from workers.lean_tasks import LeanTasks
from workers.lifecycle import AdapterReaper
from workers.op_consumer import POP_SECONDS, OpConsumer
from workers.orphans import OrphanSweep
from workers.prereads import Prereads
from workers.runtime import PoolRuntime
from workers.snapshots import AdapterSnapshots
from workers.watchdog import Watchdog

log = logging.getLogger("twinkle.worker")
HEARTBEAT_SECONDS = 2.0
STARTED_AT = time.time()  # this worker process's start
BROKER_RETRIES = 30


def broker_url_from(config: ServerConfig) -> str:
    url = os.environ.get("TWINKLE_BROKER_URL") or config.broker.url
    if not url:
        sys.exit("No broker URL: set broker.url in the config or TWINKLE_BROKER_URL (the launcher does).")
    return str(url)


def queue_for(app: Application, replica: int) -> str:
    if isinstance(app, ModelApp):
        return model_queue(app.name, replica)
    if isinstance(app, SamplerApp):
        return sampler_queue(app.name)
    return processor_queue(app.name)


def build_runtime(config: ServerConfig, app: Application, replica: int, r: redis.Redis, keys: Keys,
                  lease: PoolLease | None = None, *, fair_turns: bool = False) -> PoolRuntime:
    """The pool's runtime, its model (if any) loaded and its threads started. `fair_turns`: a model pool's fair
    share, without fused cycles, runs on one thread (workers/fair_turns.py) rather than through the clock."""
    queue = queue_for(app, replica)
    if isinstance(app, ModelApp):
        return _model_runtime(config, app, replica, queue, r, keys, lease, fair_turns=fair_turns)
    if isinstance(app, SamplerApp):
        return _sampler_runtime(config, app, queue, r, keys, lease)
    if isinstance(app, ProcessorApp):
        processor.warm_up()
        runtime = PoolRuntime(r, keys, queue, processor.handlers(), future_ttl=config.storage.future_ttl_seconds,
                              serialize=False, lease=lease)
        runtime.announce(keys.pool_info(app.name), json.dumps({"processes": app.args.ncpu_proc_per_node}))
        log.info("pool %s: ready", queue)
        return runtime
    raise SystemExit(f"application {app.name!r} ({app.import_path}) has no pool worker")


def _model_runtime(config: ServerConfig, app: ModelApp, replica: int, queue: str, r: redis.Redis, keys: Keys,
                   lease: PoolLease | None, *, fair_turns: bool = False) -> PoolRuntime:
    args = app.args
    log.info("pool %s: loading %s", queue, args.model_id)
    started = time.perf_counter()
    backend, sampler = build_model_pool(config, app, replica)  # in process, or on a Ray device group
    dtype = backend.compute_dtype if isinstance(backend, ComputeDtype) else args.torch_dtype
    model_handlers = ModelPoolHandlers(backend, sampler, CheckpointStore(config.storage.checkpoint_dir), r, keys,
                                       queue, exports=ExportSettings(args.backend, args.model_id, args.export, dtype))
    runtime = PoolRuntime(r, keys, queue, model_handlers.table(), future_ttl=config.storage.future_ttl_seconds,
                          has_adapter=backend.has_adapter, queue_timeout=args.queue_config.queue_timeout, lease=lease)
    if args.clock.enabled or (args.scheduling.policy == "fair" and not fair_turns):
        runtime.use_clock(backend, args.clock, args.scheduling, after_fused=model_handlers.residency.publish)
    adapters = args.adapter_config
    reaper = AdapterReaper(r, keys, adapter_ids=model_handlers.adapter_ids, remove=model_handlers.drop_adapter,
                           lock=runtime.lock, adapter_timeout=adapters.adapter_timeout,
                           max_lifetime=adapters.adapter_max_lifetime)
    threading.Thread(target=reaper.run_forever, name="adapter-reaper", daemon=True).start()
    if args.queue_config.execution_timeout > 0:
        Watchdog(runtime, args.queue_config.execution_timeout).start()
    if adapters.snapshot_interval > 0:
        AdapterSnapshots(model_handlers, runtime.lock, adapters.snapshot_interval).start()
    if args.full_finetune.enabled:
        _reserve_for_full_runs(runtime, model_handlers, args.full_finetune)
    _ready(config, app, runtime, args.scheduling, backend.info, backend, started)
    return runtime


def _sampler_runtime(config: ServerConfig, app: SamplerApp, queue: str, r: redis.Redis, keys: Keys,
                     lease: PoolLease | None) -> PoolRuntime:
    args = app.args
    log.info("pool %s: loading %s", queue, args.model_id)
    started = time.perf_counter()
    sampler = build_sampler(args.model_id, args.sampler_type, max_loras=args.adapter_config.max_loras,
                            engine_args=dict(args.engine_args))
    handlers = SamplerPoolHandlers(sampler, sampler_slots(app), r, fair=args.scheduling.policy == "fair")
    runtime = PoolRuntime(r, keys, queue, handlers.table(), future_ttl=config.storage.future_ttl_seconds,
                          serialize=False, queue_timeout=args.queue_config.queue_timeout, lease=lease)
    _ready(config, app, runtime, args.scheduling, sampler.info, sampler, started)
    return runtime


def _ready(config: ServerConfig, app: ModelApp | SamplerApp, runtime: PoolRuntime, scheduling: SchedulingConfig,
           info: ModelInfo, holder: Any, started: float) -> None:
    """What a model or sampler pool sets up once its model is loaded: key backlogs, metering, announcements."""
    keys = runtime.keys
    if scheduling.policy == "fair":
        runtime.backlog = BacklogRelease(runtime.r, keys, runtime.queue, scheduling.window,
                                         config.storage.future_ttl_seconds)
    if config.usage.enabled:
        runtime.ledger = UsageLedger(runtime.r, keys)
        runtime.usage_model = app.args.served_name
    runtime.announce(keys.pool_info(app.name), json.dumps(asdict(info)))
    _announce_lora_modules(runtime, keys.pool_lora_modules(app.name), holder)
    log.info("pool %s: ready in %.1f s (%s)", runtime.queue, time.perf_counter() - started, info.model_name)


def _reserve_for_full_runs(runtime: PoolRuntime, handlers: ModelPoolHandlers, full: FullFinetuneConfig) -> None:
    """Let full-parameter runs hold this pool exclusively (twinkle.pool_reservation)."""
    reservation = PoolReservation(runtime.r, runtime.keys, runtime.queue, lease_seconds=full.lease_seconds,
                                  max_hold_seconds=full.max_hold_seconds, refuse=full.while_reserved == "refuse")
    reservation.end_run = handlers.end_full_run
    handlers.reservation = runtime.reservation = reservation
    threading.Thread(target=reservation.watch_forever, args=(runtime.lock,), name="reservation", daemon=True).start()


def _announce_lora_modules(runtime: PoolRuntime, key: str, holder: Any) -> None:
    """The linear layers of a transformers model held here, which imported adapters are checked against
    (twinkle.adapter_import); torch is imported only for a pool that holds one."""
    if not isinstance(holder, SharedBase) or holder.shared is None:
        return
    from twinkle.backends.hf.lora_modules import published_shapes

    shapes = published_shapes(holder)
    if shapes is not None:
        runtime.announce(key, json.dumps(shapes))


def sampler_slots(app: SamplerApp) -> int:
    """How many sample requests a sampler pool batches together: vLLM's `max_num_seqs`, else the deployment's
    `max_ongoing_requests` (the seed's name for what one replica handles at once), else 16."""
    engine: dict[str, Any] = dict(app.args.engine_args)  # max_num_seqs passes through, undeclared
    ongoing = next((d.max_ongoing_requests for d in app.deployments or [] if d.max_ongoing_requests), None)
    return int(engine.get("max_num_seqs") or ongoing or 16)


def sampler_threads(app: SamplerApp) -> int:
    """Sample requests a sampler pool holds: the batch, and the waiting ones fair share chooses from."""
    return max(sampler_slots(app), app.args.scheduling.window)


def _held_by_celery(lean: LeanTasks | None) -> set[str]:
    """Request ids of the messages Celery's consumer holds (reserved, or taken by the lean tasks)."""
    from celery.worker import state

    return {str(task_id) for task_id in list(state.requests)} | (lean.held() if lean is not None else set())


def _held_task_ids(runtime: PoolRuntime, held: Callable[[], set[str]]) -> set[str]:
    running = runtime.current
    ids = held()
    return ids | {running.rec.request_id} if running else ids


def _heartbeat(r: redis.Redis, keys: Keys, queue: str, runtime: PoolRuntime, held: Callable[[], set[str]]) -> None:
    orphans = OrphanSweep(r, queue, lambda: _held_task_ids(runtime, held), lease=runtime.lease)
    while True:
        if runtime.lease is not None and not runtime.lease.fresh():
            time.sleep(HEARTBEAT_SECONDS)  # cut off or frozen past its lease: replaced, maybe; its renewal says
            continue
        running = runtime.current
        try:
            pipe = r.pipeline(transaction=False)
            beat = {"pid": os.getpid(), "t": time.time(), "ops_done": runtime.ops_done,
                    "current": running.rec.request_id if running else "",  # api.lost_futures reads `current`
                    "fused_ops": runtime.clock.fused_ops if runtime.clock else 0,
                    # api.lost_futures: the messages it holds in memory, and since when it runs
                    "held": sorted(_held_task_ids(runtime, held)), "since": STARTED_AT}
            pipe.set(keys.pool_heartbeat(queue), json.dumps(beat), ex=10)
            for key, value in runtime.announcements.items():
                pipe.set(key, value, nx=True)  # a restarted broker lost it
            pipe.execute()
            orphans.sweep()
            if runtime.backlog is not None:  # what a missed release left parked
                runtime.backlog.sweep(runtime.send_released)
        except redis.RedisError:
            pass  # the broker is down; Celery reconnects on its own and so do we next round
        except Exception:  # a dead heartbeat thread would make every op of this pool look lost
            log.exception("pool %s: heartbeat failed; trying again", queue)
        time.sleep(HEARTBEAT_SECONDS)


def _liveness(path: str, runtime: PoolRuntime, execution_timeout: float) -> None:
    """Rewrite the liveness file the launcher watches (twinkle/liveness.py); needs no broker."""
    while True:
        running = runtime.current
        started = time.time() - (time.monotonic() - running.started) if running else 0.0
        try:
            liveness.write(path, liveness.Liveness(
                pid=os.getpid(), t=time.time(), current=running.rec.request_id if running else "",
                op=running.rec.op if running else "", started=started, execution_timeout=execution_timeout))
        except OSError:
            log.warning("cannot write the liveness file %s", path)
        # Once a second, not per op: the start time is exact either way, and the hang watch reads the records of
        # the ops the worker holds for the moment the file is behind (twinkle/server/hang_watch.py).
        time.sleep(liveness.INTERVAL_SECONDS)


def run(config_path: str, app_name: str, replica: int = 0, loglevel: str = "INFO") -> None:
    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launched_process.quiet_library_warnings()
    config = load_config(config_path)
    app = config.app(app_name)
    url = broker_url_from(config)
    # ride out a broker restart (about a minute) instead of failing the op that was running
    r = redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=2.0), BROKER_RETRIES),
                             retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    keys = Keys(config.persistence.key_prefix)
    seconds = config.broker.pool_lease_seconds
    lease = PoolLease(client_for(url, seconds), keys, queue_for(app, replica), seconds)
    # Flower reads Celery's task events, telemetry its signals, and `launch -v` shows its per-task lines
    watched = config.flower.enabled or config.telemetry.enabled or launched_process.verbose()
    lean = LeanTasks() if LeanTasks.wanted(watched=watched, threads=not isinstance(app, ProcessorApp)) else None
    # a model pool without clock cycles that nothing watches consumes its queue itself (workers/op_consumer.py)
    own_consumer = lean is not None and isinstance(app, ModelApp) and not app.args.clock.enabled
    fair_turns = own_consumer and isinstance(app, ModelApp) and app.args.scheduling.policy == "fair"
    try:
        lease.acquire()  # before the model loads: a second worker of this pool stops here, naming the first
        lease.start_renewing()
        lease.take_over_queue()
        runtime = build_runtime(config, app, replica, r, keys, lease, fair_turns=fair_turns)
    except Exception as error:  # noqa: BLE001 - whatever stops the start, the launcher reports it in one line
        _exit_start_failed(queue_for(app, replica), error)
    lease.check_on_resume()
    celery = make_celery(url, events=config.flower.enabled)
    celery.conf.worker_consumer = "workers.broker_link:QuickReconnectConsumer"
    celery.conf.broker_transport = "workers.handover:HandoverTransport"  # no message only in this process's memory
    runtime.acked_by_finish = handover.ACKED_BY_FINISH  # its consumer skips the ack a completed op's finish made
    broker_link.tolerate_lost_acks()
    for op in Op:
        _register(celery, runtime, op, lean)
    if runtime.reservation is not None:
        queue = runtime.queue
        runtime.reservation.message_for = lambda op, rid, mid: task_message(celery, op, rid, mid, queue)
    runtime.send = lambda parked: celery.send_task(task_name(parked.op), kwargs={
        "request_id": parked.request_id, "model_id": parked.model_id}, queue=runtime.queue, task_id=parked.request_id)
    setup_worker_telemetry(config, app_name, celery)
    consumer = _op_consumer(url, app, runtime, keys, lean, fair=fair_turns) if own_consumer else None
    held = consumer.held if consumer is not None else partial(_held_by_celery, lean)
    threading.Thread(target=_heartbeat, args=(r, keys, runtime.queue, runtime, held), daemon=True).start()
    if os.environ.get(liveness.ENV):
        limits = app.args.queue_config if isinstance(app, (ModelApp, SamplerApp, ProcessorApp)) else None
        threading.Thread(target=_liveness, args=(os.environ[liveness.ENV], runtime,
                                                 float(limits.execution_timeout) if limits else 0.0),
                         name="liveness", daemon=True).start()
    # Model and sampler pools: one op at a time in one process that holds the model (threads, -c 1).
    # Processor pools: stateless CPU work in parallel processes (prefork).
    if isinstance(app, ProcessorApp):
        pool = ["-P", "prefork", "-c", str(app.args.ncpu_proc_per_node)]
    elif isinstance(app, SamplerApp):
        pool = ["-P", "threads", "-c", str(sampler_threads(app))]  # stateless: batched, may reorder
        _read_with_delivery(runtime, keys)
    else:
        # One thread runs ops in delivery order; reserving the next message while an op runs saves the fetch
        # after each ack (2.5 ms of a training step). Both stay unacked, so a crash restores them in order.
        pool = ["-P", "threads", "-c", "1", "--prefetch-multiplier", "2"]
        if runtime.clock is not None:
            # Clock cycles: one thread per op in hand, each waiting for its turn in a cycle; the consumer
            # reports every message as it arrives, so the clock knows the queue's order before the threads race.
            # With fair share it holds `scheduling.window` ops to choose from.
            clock = runtime.clock
            pool = ["-P", "threads", "-c", str(clock.hold), "--prefetch-multiplier", "1"]
            _read_with_delivery(runtime, keys)
            if lean is not None:
                lean.received = clock.arrived
            task_received.connect(lambda request, **_: clock.arrived(
                str(request.kwargs.get("request_id", "")), str(request.kwargs.get("model_id", ""))), weak=False)
    try:
        if consumer is not None:
            consumer.stop_on_signals()
            consumer.run()
            return
        celery.worker_main([
            *([] if launched_process.verbose() else ["--quiet"]),  # the banner, unless `launch -v`
            "worker", *pool, "-Q", runtime.queue, "-n", f"{runtime.queue}@%h",
            "--without-mingle", "--without-gossip", *(["-E"] if config.flower.enabled else []),
            f"--loglevel={loglevel}",
        ])
    finally:
        lease.release()  # a clean stop: the launcher's restart need not wait for the lease to expire


def _op_consumer(url: str, app: Application, runtime: PoolRuntime, keys: Keys, lean: LeanTasks | None, *,
                 fair: bool) -> OpConsumer:
    """The pool's consumer of its own queue: one message at a time, or with fair share the window of them it picks
    from (FairTurns); each message's read goes with its delivery record."""
    assert lean is not None and isinstance(app, ModelApp), "a model pool's, with the lean tasks' runners"
    prereads = runtime.prereads = Prereads(keys)
    client = redis.Redis.from_url(url, socket_timeout=POP_SECONDS + 5, socket_connect_timeout=1)
    return OpConsumer(client, runtime.queue, lean.runners, acked_by_finish=handover.ACKED_BY_FINISH,
                      prereads=prereads, turns=FairTurns(prereads) if fair else None,
                      window=app.args.scheduling.window if fair else 1)


def _read_with_delivery(runtime: PoolRuntime, keys: Keys) -> None:
    """The pool holds its delivered messages to choose among them, so each one's read goes with its delivery record
    (workers/prereads.py)."""
    runtime.prereads = handover.PREREADS = Prereads(keys)


def _exit_start_failed(queue: str, error: Exception) -> NoReturn:
    """Leave the one-line cause for the launcher and exit with PoolExit.START_FAILED; the traceback only with
    `launch -v` or when run on its own (the same traceback at every retry hides the cause)."""
    cause = launched_process.write_cause(error)
    if launched_process.verbose() or not launched_process.started_by_launcher():
        # a pool another worker holds: the line names it, a traceback would only bury it
        log.error("pool %s failed to start: %s", queue, cause,
                  exc_info=None if isinstance(error, PoolLeaseHeld) else error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PoolExit.START_FAILED)  # no interpreter teardown: a half-started Ray or model must not hang it


def _register(celery: Any, runtime: PoolRuntime, op: Op, lean: LeanTasks | None = None) -> None:
    def run(request_id: str, model_id: str, delivery_tag: str) -> None:
        with op_span(op, request_id, model_id):
            runtime.execute(op, request_id, model_id, delivery_tag=delivery_tag)

    def task(self: Any, request_id: str, model_id: str = "") -> None:
        # kombu's delivery tag is a message property: Celery's delivery_info leaves it out
        run(request_id, model_id, str((getattr(self.request, "properties", None) or {}).get("delivery_tag", "")))

    task.__name__ = op.value
    options: dict[str, Any] = {}
    if lean is not None:
        lean.runners[task_name(op)] = run
        options["Strategy"] = lean.strategy
    celery.task(name=task_name(op), ignore_result=True, bind=True, **options)(task)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers", description="Run one Twinkle pool worker.")
    parser.add_argument("-c", "--config", default=os.environ.get("TWINKLE_SERVER_CONFIG"), required=False)
    parser.add_argument("--app", required=True, help="application name from the config")
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--loglevel", default=os.environ.get("TWINKLE_LOG_LEVEL", "INFO"))
    ns = parser.parse_args(argv)
    if not ns.config:
        parser.error("no config: pass -c or set TWINKLE_SERVER_CONFIG")
    run(ns.config, ns.app, ns.replica, ns.loglevel)
