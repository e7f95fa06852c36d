"""The bookkeeping around every op a pool runs: future states, duplicates, lost state, results.

One runtime per pool process. Celery tasks are thin: they call `PoolRuntime.execute(op, request_id)`,
which never raises, so every message is acked exactly when its future reached a terminal state.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from twinkle import blobs
from twinkle.backlog import BacklogRelease, Parked
from twinkle.checkpoints import parse_checkpoint_path, storage_failure
from twinkle.config.clock import ClockConfig, SchedulingConfig
from twinkle.errors import AdapterGone, BackendFailure, TwinkleError, lost_state_error
from twinkle.futures import FutureRecord, FutureStatus, Op
from twinkle.keys import Keys
from twinkle.ledger import SyncLedger, lifecycle
from twinkle.ledger.call import Call
from twinkle.ledger.lifecycle import Refused
from twinkle.pool_lease import PoolLease
from twinkle.pool_reservation import PoolReservation
from twinkle.queue_timeouts import queue_timeout_error
from twinkle.queued_ops import QueuedOps
from twinkle.records import ModelRecord
from twinkle.run_metrics import RunMetrics
from twinkle.script_batch import ScriptCall
from twinkle.telemetry import annotate_op_span, record_usage, task_finished, task_started
from twinkle.usage import SAVE_OPS, UsageLedger, amounts_for, recorded
from workers.clock import Clock, FusedRunner, Job
from workers.lost_adapters import LostAdapterOps
from workers.prereads import Prereads

log = logging.getLogger("twinkle.worker")
UNFUSED_HANDOVER_MS = 2.0  # without clock cycles: how long a pick waits for ops delivered but not yet read
LOST_RESWEEP_SECONDS = 10.0  # a lost adapter's waiting ops are failed together at most this often

Handler = Callable[[FutureRecord, Any], Any]


@dataclass(frozen=True)
class RunningOp:
    rec: FutureRecord
    started: float  # time.monotonic()


class PoolRuntime:
    def __init__(self, r: redis.Redis, keys: Keys, queue: str, handlers: dict[str, Handler], *,
                 future_ttl: int, has_adapter: Callable[[str], bool] | None = None, serialize: bool = True,
                 queue_timeout: float = 0, lease: PoolLease | None = None) -> None:
        self.r = r
        self.lease = lease  # this worker's claim on the queue: a worker that lost it writes no outcome
        self.keys = keys
        self.queue = queue
        self.handlers = handlers
        self.future_ttl = future_ttl
        self.has_adapter = has_adapter
        self.ops_done = 0
        self.queue_timeout = queue_timeout  # seconds an op may wait in the queue (0 = forever)
        # Model pools: ops and the adapter reaper never touch the backend at once. Sampler and processor
        # pools run several ops concurrently (their handlers synchronise what they share).
        self.lock: Any = threading.Lock() if serialize else contextlib.nullcontext()
        self.futures = SyncLedger(r)  # their lifecycle (twinkle.ledger)
        self.current: RunningOp | None = None  # the op in its handler (model pools), for the hang watchdog
        self.prereads: Prereads | None = None  # reads sent with each delivery's record (workers/prereads.py)
        # Where a completed op's finish, which then acknowledges its message too, leaves its delivery tag for a
        # consumer that skips its own ack of it (workers/handover.py); None: the consumer acks every message.
        self.acked_by_finish: set[str] | None = None
        self.clock: Clock | None = None  # set by `use_clock`: ops of many adapters run in fused cycles
        self.announcements: dict[str, str] = {}  # keys the heartbeat restores should the broker lose them
        self.metrics = RunMetrics(r, keys)  # per-run step metrics and recent failures, for the console
        self.ledger: UsageLedger | None = None  # set by the pool when usage metering is on
        self.usage_model = ""  # the base model's served name, the `model` of its usage records
        self.backlog: BacklogRelease | None = None  # set by the pool when keys' ops wait in backlogs (fair share)
        self.send: Callable[[Parked], None] | None = None  # sends a released op's message to this pool's queue
        self._lost_swept: dict[str, float] = {}  # lost adapters whose waiting ops were failed together, and when
        self.reservation: PoolReservation | None = None  # set by a model pool that allows full-parameter runs

    def execute(self, op: str, request_id: str, model_id: str = "", *, delivery_tag: str = "") -> None:
        """Run one op; `model_id` is the one its message names (it saves a read), or "" when it names none;
        `delivery_tag` names its broker message, which a completed op's finish acknowledges (workers/handover.py)."""
        try:
            self._execute(op, request_id, model_id, delivery_tag)
        finally:
            if self.clock is not None:
                self.clock.leave(request_id)

    def _execute(self, op: str, request_id: str, model_id: str = "", delivery_tag: str = "") -> None:
        rec, payload, model_raw = self._read(request_id, model_id)
        if rec is None:
            log.warning("future %s is gone (expired?); dropping %s", request_id, op)
            return
        model = ModelRecord.from_hash(model_raw) if model_raw else None
        if rec.state.terminal:
            # A redelivery, or an op failed while queued (queue_timeout, a lost adapter's backlog): no turn taken,
            # and its key's next parked op may enter the queue now.
            log.info("duplicate delivery of %s %s ignored", op, request_id)
            self._release_backlog(rec)
            return
        annotate_op_span(rec)
        if rec.state is FutureStatus.RUNNING:
            # It was running when its worker died: whatever it did to the adapter is lost, and so is the adapter
            # for the ops of it queued behind (none of them can have begun before this one).
            lost = self._lost(rec.model_id, model)
            if self.has_adapter is not None and rec.model_id and not self.has_adapter(rec.model_id):
                self._fail_lost_adapters_waiting_ops(rec, lost)
            self._fail(rec, lost)
            return
        started = time.perf_counter()
        timing = _Timing()
        args = None
        try:
            self._check_waited(op, rec)
            args = blobs.loads(payload) if payload else None
            result = self._run(op, rec, model, args, timing)
        except _Vanished:
            log.warning("future %s vanished from the broker (restarted?); %s not run", request_id, op)
            return
        except _EndedWhileHeld:
            log.info("%s %s ended while this pool held it; not run", op, request_id)
            self._release_backlog(rec)
            return
        except _Parked:
            log.info("%s %s waits: a full-parameter run holds the pool", op, request_id)
            return
        except TwinkleError as exc:
            self._release_if_never_created(op, rec, model, exc)
            self._fail(rec, exc)
            self._meter_failed(rec, timing)
        except Exception as exc:  # noqa: BLE001 - any backend bug becomes a failed future, never a hang
            log.error("%s %s failed:\n%s", op, request_id, traceback.format_exc())
            failure = storage_failure(exc) or BackendFailure(  # a full or read-only disk says so
                f"{op} failed inside the server ({type(exc).__name__}).",
                hint=f"This is a server problem; report request id {request_id} to the operator.",
            )
            self._release_if_never_created(op, rec, model, failure)
            self._fail(rec, failure)
            self._meter_failed(rec, timing)
        else:
            self._complete(rec, result, amounts_for(op, args, result, seconds=timing.seconds,
                                                    checkpoint_bytes=self._checkpoint_bytes(op, result)),
                           delivery_tag)
        finally:
            self.ops_done += 1
            log.debug("%s %s took %.1f ms", op, request_id, (time.perf_counter() - started) * 1000)

    def _run(self, op: str, rec: FutureRecord, model: ModelRecord | None, args: Any, timing: _Timing) -> Any:
        """Begin, check and run the op: now under the pool's lock, or at its turn in a clock cycle."""

        def prepare() -> None:
            self._check_waited(op, rec)  # again at its turn: a pool holds many ops while it chooses between them
            self._check_not_ended(rec)
            self._check_reservation(op, rec)
            if not self._begin(rec):
                raise _Vanished
            timing.began = True
            self._check_adapter_alive(op, rec, model)

        def call() -> Any:
            began = time.perf_counter()
            try:
                return self.handlers[op](rec, args)
            finally:
                timing.seconds = time.perf_counter() - began

        if self.clock is not None:
            job = Job(op, rec, args, prepare, call)
            try:
                return self.clock.run(job)
            finally:
                timing.seconds = timing.seconds or job.seconds
        with self.lock:  # prepared under the lock, as in a clock cycle: a reservation changes only under it
            prepare()
            with self._running(rec):
                return call()

    def announce(self, key: str, value: str) -> None:
        """Publish a value other processes read (the pool's model info) and keep it published."""
        self.announcements[key] = value
        self.r.set(key, value)

    def abandon_current(self, exc: TwinkleError) -> FutureRecord | None:
        """Fail the op inside its handler now; the hang watchdog does this just before the process exits."""
        running = self.current
        if running is None:
            return None
        self._fail(running.rec, exc)
        return running.rec

    def use_clock(self, backend: Any, config: ClockConfig, scheduling: SchedulingConfig,
                  after_fused: Callable[[], None] | None = None) -> Clock:
        """Choose this model pool's next op by `scheduling` (`workers.fair_share`) and, with `config.enabled`,
        run ops in fused clock cycles (`workers.clock`) from now on; `after_fused` runs after each fused pass,
        as the pool's handlers run their own epilogue after each op."""
        fuser = FusedRunner(backend, after_fused) if config.enabled and FusedRunner.available(backend) else None
        self.clock = Clock(self.lock, self._running, fuser, window_ms=config.window_ms if config.enabled
                           else UNFUSED_HANDOVER_MS, max_ops=config.max_ops, max_tokens=config.max_tokens,
                           gather=config.enabled, fair=scheduling.policy == "fair", hold=scheduling.window).start()
        return self.clock

    # -- usage ---------------------------------------------------------------------------------

    def _usage_call(self, rec: FutureRecord, amounts: dict[str, int]) -> ScriptCall | None:
        return self.ledger.call(rec, self.usage_model, amounts) if self.ledger is not None else None

    def _recorded(self, rec: FutureRecord, replies: list[Any], usage: ScriptCall | None,
                  amounts: dict[str, int]) -> None:
        """Report the run metrics and usage writes that failed (neither ever fails an op that already ended), and
        count the usage the broker added."""
        for reply in replies:
            if isinstance(reply, Exception):
                log.warning("metrics or usage of %s %s not recorded: %s", rec.op, rec.request_id, reply)
        if usage is not None and replies and not isinstance(replies[-1], Exception) and recorded(replies[-1]):
            record_usage(rec, self.usage_model, amounts)

    def _meter_failed(self, rec: FutureRecord, timing: _Timing) -> None:
        """A failed op that ran is charged the pool time it held, nothing else."""
        if not timing.began or self.ledger is None:
            return
        amounts = {"pool_ms": round(timing.seconds * 1000)}
        try:
            if self.ledger.record(rec, self.usage_model, amounts):
                record_usage(rec, self.usage_model, amounts)
        except redis.RedisError:
            log.warning("usage of %s %s not recorded: the broker is unreachable", rec.op, rec.request_id)

    def _checkpoint_bytes(self, op: str, result: Any) -> int:
        if op not in SAVE_OPS or not isinstance(result, dict) or not result.get("path"):
            return 0
        ref = parse_checkpoint_path(str(result["path"]))
        entry = self.r.hget(self.keys.checkpoints(ref.run_id), ref.checkpoint_id)
        return int(json.loads(entry).get("size_bytes") or 0) if entry else 0

    @contextlib.contextmanager
    def _running(self, rec: FutureRecord) -> Iterator[None]:
        if isinstance(self.lock, contextlib.nullcontext):  # concurrent pools: no single current op
            yield
            return
        self.current = RunningOp(rec, time.monotonic())
        try:
            yield
        finally:
            self.current = None

    # -- steps ---------------------------------------------------------------------------------

    def _read(self, request_id: str, model_id: str = "") -> tuple[FutureRecord | None, bytes | None, dict[Any, Any]]:
        """The future record, its payload and its model's record: one round trip when the message named the model
        the record names (every message the API and the backlogs send does), two otherwise."""
        kept = self.prereads.take(request_id, model_id) if self.prereads is not None else None
        read = kept or self.futures.run(lifecycle.read_for_run(self.keys, request_id, model_id))
        recorded = read.record.model_id if read.record is not None else ""
        if recorded == model_id:
            return read.record, read.payload, read.model
        return read.record, read.payload, self.r.hgetall(self.keys.model(recorded)) if recorded else {}

    def _begin(self, rec: FutureRecord) -> bool:
        """Mark the op running, count it on its model and advance the queue position, in one round trip.
        False when the future is gone: a broker restarted without persistence lost it, and writing now would
        leave partial records."""
        began = self.futures.run(lifecycle.begin(self.keys, rec, queue=rec.queue or self.queue,
                                                 fence_key=self._fence_key(), token=self._fence_token()))
        if began is Refused.FENCED_OFF:
            self._fenced_off(rec, "was not begun")
            return False
        if began is Refused.ALREADY_ENDED:  # a sweep failed it (queue timeout, lost adapter) since its last read
            raise _EndedWhileHeld
        if began is Refused.GONE:
            return False
        task_started(rec)
        return True

    def _check_waited(self, op: str, rec: FutureRecord) -> None:
        """An op that waited past queue_timeout fails instead of running late: its client gave up or would
        rather resubmit, and running it now only delays everyone queued behind it."""
        waited = time.time() - rec.created_at
        if self.queue_timeout > 0 and rec.created_at > 0 and waited > self.queue_timeout:
            if self._ended(rec):  # the API's sweep failed it while this pool held it (twinkle.queue_timeouts)
                raise _EndedWhileHeld
            raise queue_timeout_error(op, f"{waited:.0f}", self.queue, self.queue_timeout)

    def _check_reservation(self, op: str, rec: FutureRecord) -> None:
        """While a full-parameter run holds the pool (twinkle.pool_reservation), another run's op waits parked
        (or, where the pool refuses, fails with PoolReserved); the holder's own ops renew its lease."""
        reservation = self.reservation
        if reservation is None:
            return
        if not reservation.diverts(rec):
            reservation.renew(rec.model_id)
            return
        if reservation.park(op, rec):
            raise _Parked
        # the reservation's record is gone (an operator deleted it, a broker without persistence restarted):
        # the run ends before any other op touches the weights it changed
        holder = reservation.holder or ""
        if reservation.end_run is not None:
            reservation.end_run(holder, "its pool reservation vanished from the broker")
        reservation.end("its record vanished")

    def _check_adapter_alive(self, op: str, rec: FutureRecord, model: ModelRecord | None) -> None:
        if self.has_adapter is None or op in (Op.CREATE_MODEL, Op.SAMPLE, Op.UNLOAD_MODEL) or not rec.model_id:
            return
        if model is not None and model.status != "active":
            raise AdapterGone(f"Model {rec.model_id} was unloaded: {model.unload_reason or 'unloaded'}.",
                              hint="Create a new model" + (f" and load {model.last_checkpoint}."
                                                           if model.last_checkpoint else "."))
        if op != Op.LOAD_STATE and not self.has_adapter(rec.model_id):
            lost = self._lost(rec.model_id, model)
            self._fail_lost_adapters_waiting_ops(rec, lost)
            raise lost

    def _fail_lost_adapters_waiting_ops(self, rec: FutureRecord, lost: TwinkleError) -> None:
        """The first time an adapter is found lost, fail its other waiting ops at once (workers.lost_adapters);
        again only after LOST_RESWEEP_SECONDS, should the client go on submitting to it."""
        if time.monotonic() - self._lost_swept.get(rec.model_id, -LOST_RESWEEP_SECONDS) < LOST_RESWEEP_SECONDS:
            return
        self._lost_swept[rec.model_id] = time.monotonic()
        try:
            LostAdapterOps(QueuedOps(self.r, self.keys, ttl=self.future_ttl), self.queue).fail_waiting(
                rec.model_id, rec.owner, lost)
        except redis.RedisError:  # each op still fails at its own turn
            log.warning("could not fail the waiting ops of lost model %s at once", rec.model_id, exc_info=True)

    def _check_not_ended(self, rec: FutureRecord) -> None:
        """An op of a lost adapter this pool held while its waiting ops were failed together ended meanwhile:
        it must not be begun (that would overwrite its outcome)."""
        if rec.model_id in self._lost_swept and self._ended(rec):
            raise _EndedWhileHeld

    def _ended(self, rec: FutureRecord) -> bool:
        """Whether the op's record is terminal now (read again: it was queued when this pool read it)."""
        return self.futures.run(lifecycle.ended(self.keys, rec.request_id))

    def _release_if_never_created(self, op: str, rec: FutureRecord, model: ModelRecord | None,
                                  exc: TwinkleError) -> None:
        """A model whose first op (create, or load from a checkpoint) failed never got an adapter: free its
        place in the owner's model count, or the count drifts up with every failed create. It runs before the
        failure is written, so a client that reads the failure also reads the count already freed."""
        if op not in (Op.CREATE_MODEL, Op.LOAD_STATE) or model is None or model.ops_executed:
            return
        if self.has_adapter is not None and self.has_adapter(rec.model_id):
            return
        pipe = self.r.pipeline()
        pipe.hset(self.keys.model(rec.model_id), mapping={"status": "unloaded",
                                                          "unload_reason": f"it could not be created: {exc}"})
        pipe.srem(self.keys.owner_models(model.owner), rec.model_id)
        try:
            pipe.execute()
        except redis.RedisError:  # the failure must still be written: a future never stays pending
            log.warning("could not release model %s, whose create failed", rec.model_id, exc_info=True)

    def _lost(self, model_id: str, model: ModelRecord | None) -> TwinkleError:
        return lost_state_error(model_id, (model.last_checkpoint if model else "") or None)

    def _complete(self, rec: FutureRecord, result: Any, amounts: dict[str, int], delivery_tag: str = "") -> None:
        """Write the outcome and acknowledge the op's message, release the key's backlog, append the run's metrics
        and count the usage: one round trip. The metrics count only where the outcome was written (the script
        checks the record's finish time)."""
        finished_at = str(time.time())
        metrics = self.metrics.call(rec, result, finished_at)
        usage = self._usage_call(rec, amounts)
        acked = self.acked_by_finish
        tag = delivery_tag if acked is not None else ""
        finished, replies = self._finish(rec, FutureStatus.COMPLETED, blobs.dumps(result), finished_at=finished_at,
                                         along=[call for call in (metrics, usage) if call is not None],
                                         delivery_tag=tag)
        if finished:
            if tag and acked is not None:
                acked.add(tag)
            task_finished(rec, FutureStatus.COMPLETED, result=result)
        self._recorded(rec, replies, usage, amounts)

    def _fail(self, rec: FutureRecord, exc: TwinkleError) -> None:
        log.info("%s %s failed: %s", rec.op, rec.request_id, exc)
        finished, _ = self._finish(rec, FutureStatus.FAILED, b"", error=str(exc), category=exc.category,
                                   code=exc.code)
        if finished:
            task_finished(rec, FutureStatus.FAILED, error=exc)
            self.metrics.record_failure(rec, exc)

    def _finish(self, rec: FutureRecord, status: FutureStatus, result: bytes, *, finished_at: str = "",
                along: Sequence[Call[Any] | ScriptCall] = (), delivery_tag: str = "",
                **failure: str) -> tuple[bool, list[Any]]:
        """Write the outcome and wake its long-polls in one script, only where the future still exists; in the
        same round trip, release the key's backlog and run the scripts `along`. Whether the outcome was written,
        and the replies of `along`.

        A broker that restarted without persistence lost the record: writing then would leave a partial
        record nobody owns (and the API already reports such a future as lost). One script, not a check and
        a write, because a client retrying a write across a broker restart must not recreate it either."""
        call = lifecycle.finish(self.keys, rec.request_id, status, result, ttl=self.future_ttl,
                                fence_key=self._fence_key(), token=self._fence_token(), failure=failure,
                                finished_at=finished_at, delivery_tag=delivery_tag)
        backlog = self.backlog
        if backlog is None:
            refused, replies = self.futures.run_with(call, along)
            return self._written(rec, refused), replies
        with backlog.lock:  # held until the released ops are sent: each key's go out in backlog order
            refused, [released, *replies] = self.futures.run_with(
                call, [backlog.release_call(rec.owner, rec.request_id), *along])
            if refused is not Refused.FENCED_OFF:
                self._sending_released(rec, lambda: backlog.dispatch(rec.owner, released, self.send_released))
            elif not isinstance(released, Exception):
                backlog.put_back(rec.owner, released)  # for the worker that holds the queue now to send
        return self._written(rec, refused), replies

    def _written(self, rec: FutureRecord, refused: Refused | None) -> bool:
        if refused is Refused.FENCED_OFF:
            self._fenced_off(rec, "has its outcome dropped")
            return False
        if refused is Refused.GONE:
            log.warning("future %s vanished from the broker (restarted?); its outcome is dropped", rec.request_id)
        return refused is None

    # -- the pool lease (twinkle.pool_lease) ----------------------------------------------------

    def _fence_key(self) -> str:
        return self.lease.fence_key if self.lease is not None else ""

    def _fence_token(self) -> str:
        return self.lease.token if self.lease is not None else ""

    def _fenced_off(self, rec: FutureRecord, what: str) -> None:
        """Another worker took this pool's queue: this one wrote nothing and stops now (the lease's `on_lost`
        exits the process; the new holder runs or fails the op)."""
        assert self.lease is not None, "only a worker with a lease is fenced off"
        self.lease.lost(f"{rec.op} {rec.request_id} {what}: another worker took over its queue's lease")

    # -- the keys' backlogs (twinkle.backlog) ----------------------------------------------------

    def _release_backlog(self, rec: FutureRecord) -> None:
        """The op's key has one op fewer in the queue: send its next parked ones."""
        backlog = self.backlog
        if backlog is not None:
            self._sending_released(rec, lambda: backlog.finished(rec.owner, rec.request_id, self.send_released))

    def _sending_released(self, rec: FutureRecord, release: Callable[[], object]) -> None:
        """Run `release`, which sends the key's released ops; a failure waits for the heartbeat's sweep."""
        try:
            release()
        except Exception:  # the broker is away; the heartbeat's sweep sends them once it is back
            log.warning("backlog of %s not released (the heartbeat retries)", rec.owner, exc_info=True)

    def send_released(self, parked: Parked) -> None:
        """Send a released op's message to this pool's queue."""
        assert self.send is not None, "a pool with a backlog sends its released ops"
        self.send(parked)


@dataclass
class _Timing:
    """How long one op held the pool: began once it was marked running, seconds once its handler returned."""

    began: bool = False
    seconds: float = 0.0


class _Vanished(Exception):  # a signal between two steps of one op, never reported
    """The future is gone from the broker: the op is dropped without a trace."""


class _Parked(Exception):  # a signal between two steps of one op, never reported
    """The op waits out a full-parameter run's hold of the pool: its message went to the parked list."""


class _EndedWhileHeld(Exception):  # a signal between two steps of one op, never reported
    """The op's record became terminal while the pool held it: it is skipped like a duplicate delivery."""

