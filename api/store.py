"""The API's view of Twinkle state in Redis: futures, sessions, models, sampling sessions.

Every read takes the caller's tenant id; a record owned by another tenant is reported exactly like a
missing one (NotFound), so ids cannot be probed across tenants.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from celery import Celery

from api.lost_futures import LostFutures
from api.reservations import refuse_while_held, renew_for_session
from twinkle import blobs
from twinkle.backlog import ADMIT, MIN_SHARE, BacklogKeys
from twinkle.celery_app import task_name
from twinkle.errors import AdapterGone, BrokerUnavailable, Expired, LimitExceeded, NotFound
from twinkle.futures import FutureRecord, FutureStatus, new_request_id, request_id_created_at
from twinkle.keys import Keys
from twinkle.ledger import AsyncLedger, lifecycle
from twinkle.ledger.call import text
from twinkle.recent import Recent
from twinkle.records import ModelRecord, SamplingSessionRecord, SessionRecord
from twinkle.task_message import task_message
from twinkle.telemetry import submit_trace
from twinkle.tenancy import DEFAULT_POLICY, TenantPolicy, combined_limit, training_runs_exceeded

BROKER_IDENTITY_MAX_AGE = 2.0  # seconds between run_id checks
KEPT_RECORDS = 4096  # models and sampling sessions whose unchanging fields are kept (the least recent go)
READ_AHEAD_RESULTS = 256  # results read along with their record and not taken yet: past this, the oldest go


def broker_start_time(info: dict[str, Any]) -> float:
    """A time no earlier than the broker's start, from its INFO server section.

    Redis counts uptime in whole seconds from its start time rounded down, so `now - uptime` can fall up to
    a second before the real start; a request accepted in that second, and lost, would read as unknown
    instead of lost. The second after the rounded-down start is never before the real one.
    """
    now = int(info.get("server_time_usec", time.time() * 1e6)) / 1e6
    return math.floor(now) - int(info.get("uptime_in_seconds", 0)) + 1.0


class Store:
    def __init__(self, r: aioredis.Redis, keys: Keys, celery: Celery, *, future_ttl: int,
                 session_ttl: int, backlog_windows: dict[str, int] | None = None, direct_send: bool = False,
                 reserving_queues: dict[str, str] | None = None) -> None:
        self.r = r
        self.keys = keys
        self.celery = celery
        # The submit script pushes the op's broker message itself (twinkle.task_message): one round trip for the
        # record, the key's admission and the message, and no thread. Off where Flower or OpenTelemetry needs
        # Celery's publish hooks (its task-sent events, its trace headers): those send through Celery.
        self.direct_send = direct_send
        self.future_ttl = future_ttl
        self._submitting: Recent[str, ModelRecord] = Recent(KEPT_RECORDS)  # model_to_submit's
        self._sampling_sessions: Recent[str, SamplingSessionRecord] = Recent(KEPT_RECORDS)
        self.session_ttl = session_ttl
        self.broker_started_at = 0.0
        self._results_read: dict[str, bytes] = {}  # completed results read with their record (`future`), oldest first
        self.broker_run_id = ""
        self._identity_checked = 0.0
        self._identity_refresh: asyncio.Future[None] | None = None
        self.lost = LostFutures(r, keys)
        self.ledger = AsyncLedger(r)  # the futures' lifecycle (twinkle.ledger)
        self.backlog = BacklogKeys(keys)
        self.backlog_windows = backlog_windows or {}  # queues whose keys' ops beyond their share wait parked
        self._admit_script = r.register_script(ADMIT)
        # pools a full-parameter run may hold (queue -> "wait" | "refuse"), twinkle.pool_reservation
        self.reserving_queues = reserving_queues or {}
        self.submitted: Callable[[FutureRecord], None] | None = None  # told of each future submitted here

    async def refresh_broker_identity(self) -> None:
        info = await self.r.info("server")
        self.broker_run_id = str(info.get("run_id", ""))
        self.broker_started_at = broker_start_time(info)
        self._identity_checked = time.monotonic()

    async def _fresh_broker_identity(self) -> None:
        """Notice a broker restart within a couple of seconds (a restart changes the run_id)."""
        if time.monotonic() - self._identity_checked > BROKER_IDENTITY_MAX_AGE:
            # one INFO for every request that finds it stale at once (thousands of long-polls waking together)
            if self._identity_refresh is None or self._identity_refresh.done():
                self._identity_refresh = asyncio.ensure_future(self.refresh_broker_identity())
            await asyncio.shield(self._identity_refresh)

    # -- futures -------------------------------------------------------------------------------

    async def submit(self, *, op: str, owner: str, model_id: str, queue: str, payload: Any,
                     seq_id: int | None = None, dedupe_scope: str | None = None, request_id: str = "",
                     weight: float = 1.0, check_model: bool = False) -> str:
        """Store the payload and the future record, then publish.

        A retried submit with the same (scope, seq_id), the scope being the model unless given, gets
        the first submit's request id back and runs once. `request_id` is one from `new_request_id`
        that the caller needed before submitting (to reserve a checkpoint write); by default a new one.
        `weight` is the owner's fair-share weight (its tier's or its key's, twinkle.tenancy), kept on the record
        for the pool's scheduler. `check_model`: the model must be the owner's active one when the op is stored,
        checked in the same script (a record from `model_to_submit`, whose status may be old, relies on it).
        """
        if self.reserving_queues.get(queue) == "refuse":
            await refuse_while_held(self.r, self.keys, queue, model_id)
        request_id = request_id or new_request_id()
        scope = dedupe_scope or model_id
        dedupe_key = self.keys.dedupe(scope, seq_id) if seq_id is not None and scope else ""
        record = FutureRecord(request_id=request_id, op=op, owner=owner, model_id=model_id, queue=queue,
                              seq_id=-1 if seq_id is None else seq_id, created_at=time.time(),
                              broker_run_id=self.broker_run_id, weight=weight,
                              trace=submit_trace(request_id, op, model_id, queue, scope))
        if self.direct_send:
            winner = await self.ledger.run(lifecycle.submit_and_send(
                self.keys, record, blobs.dumps(payload), dedupe_key=dedupe_key, ttl=self.future_ttl,
                backlog=self.backlog.of(queue, owner), window=self.backlog_windows.get(queue, 0),
                message=task_message(self.celery, op, request_id, model_id, queue), check_model=check_model))
            await self._refused_model(winner, model_id, owner)
            if winner == request_id and self.submitted is not None:
                self.submitted(record)
            return winner
        winner = await self.ledger.run(lifecycle.submit(self.keys, record, blobs.dumps(payload),
                                                        dedupe_key=dedupe_key, ttl=self.future_ttl,
                                                        check_model=check_model))
        await self._refused_model(winner, model_id, owner)
        if winner != request_id:
            return winner  # a retried submit: the first one's future, run once
        if not await self._admit(request_id, op, owner, model_id, queue):
            return request_id  # parked in its key's backlog: its pool sends it when the key's earlier ops end
        try:
            await asyncio.to_thread(self.celery.send_task, task_name(op), kwargs={
                "request_id": request_id, "model_id": model_id}, queue=queue, task_id=request_id)
        except Exception as exc:
            await self.ledger.run(lifecycle.withdraw(self.keys, request_id, sent_key=self.backlog.sent(queue, owner),
                                                     dedupe_key=dedupe_key))
            raise BrokerUnavailable("The job queue is unreachable.", hint="Retry in a few seconds.") from exc
        return request_id

    async def _admit(self, request_id: str, op: str, owner: str, model_id: str, queue: str) -> bool:
        """Whether the op goes to the broker queue now, or waits in its key's backlog (twinkle.backlog)."""
        window = self.backlog_windows.get(queue, 0)
        if not window:
            return True
        sent = await self._admit_script(keys=self.backlog.of(queue, owner), args=[
            owner, request_id, op, model_id, window, MIN_SHARE, self.future_ttl, time.time()])
        return bool(int(sent))

    async def future(self, request_id: str, owner: str) -> FutureRecord:
        """The caller's future record. A completed one's result is read in the same round trip and kept for the
        `result` call that follows (a long-poll woken by its future's end answers with one read, not two)."""
        record, out = await self.ledger.run(lifecycle.read_with_result(self.keys, request_id))
        if record is not None:
            if record.owner == owner:
                if record.state.terminal:
                    if out is not None and record.state is FutureStatus.COMPLETED:
                        self.keep_result(request_id, out)
                    return record
                await self._fresh_broker_identity()
                return await self.lost.check(record, self.broker_run_id, broker_started_at=self.broker_started_at)
            raise NotFound(f"Future {request_id} not found.")
        created = request_id_created_at(request_id)
        if created is not None and created < time.time() - self.future_ttl:
            raise Expired(f"Future {request_id} has expired.", hint="Results are kept for "
                          f"{self.future_ttl} s; submit the request again.")
        await self.refresh_broker_identity()  # uncached: a restart a moment ago must count
        if created is not None and self.broker_started_at and created < self.broker_started_at:
            # Redis restarted without persistence after this request was accepted: it is gone.
            return FutureRecord(request_id=request_id, op="", owner=owner, model_id="", queue="",
                                status=FutureStatus.FAILED, category="server", code="request_lost",
                                error="The server's queue restarted and lost this request. Submit it again.")
        raise NotFound(f"Future {request_id} not found.")

    def keep_result(self, request_id: str, data: bytes) -> None:
        """Keep a completed future's result for the `result` call that follows."""
        self._results_read[request_id] = data
        while len(self._results_read) > READ_AHEAD_RESULTS:  # records read by no one asking for their result
            del self._results_read[next(iter(self._results_read))]

    async def result(self, request_id: str) -> Any:
        data: bytes | str | None = self._results_read.pop(request_id, None)
        if data is None:
            data = await self.ledger.run(lifecycle.result(self.keys, request_id))
        if data is None:
            raise Expired(f"The result of {request_id} is no longer available.", hint="Submit the request again.")
        return blobs.loads(data if isinstance(data, bytes) else data.encode())

    async def queue_position(self, record: FutureRecord) -> int:
        return await self.ledger.run(lifecycle.queue_position(self.keys, record))

    # -- sessions ------------------------------------------------------------------------------

    async def create_session(self, owner: str, *, tags: list[str], user_metadata: dict[str, Any],
                             sdk_version: str) -> SessionRecord:
        now = time.time()
        session = SessionRecord(session_id=f"s{uuid.uuid4().hex[:16]}", owner=owner, created_at=now,
                                last_heartbeat=now, tags=tags, user_metadata=user_metadata,
                                sdk_version=sdk_version)
        key = self.keys.session(session.session_id)
        pipe = self.r.pipeline()
        pipe.hset(key, mapping=session.to_hash())
        pipe.expire(key, self.session_ttl)
        pipe.sadd(self.keys.owner_sessions(owner), session.session_id)
        await pipe.execute()
        return session

    async def session(self, session_id: str, owner: str) -> SessionRecord:
        raw = await self.r.hgetall(self.keys.session(session_id))
        if not raw or SessionRecord.from_hash(raw).owner != owner:
            raise NotFound(f"Session {session_id} not found.", hint="Create a new session.")
        return SessionRecord.from_hash(raw)

    async def heartbeat(self, session_id: str, owner: str) -> None:
        await self.session(session_id, owner)
        key = self.keys.session(session_id)
        pipe = self.r.pipeline()
        pipe.hset(key, "last_heartbeat", time.time())
        pipe.expire(key, self.session_ttl)
        await pipe.execute()
        if self.reserving_queues:
            await renew_for_session(self.r, self.keys, list(self.reserving_queues), session_id)

    async def finish_session(self, session_id: str, owner: str, reason: str) -> None:
        await self.session(session_id, owner)
        await self.r.hset(self.keys.session(session_id), "finished", reason or "success")

    async def list_sessions(self, owner: str) -> list[str]:
        members = await self.r.smembers(self.keys.owner_sessions(owner))
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    # -- models (training runs) ----------------------------------------------------------------

    async def add_model(self, record: ModelRecord, *, limit: int, policy: TenantPolicy = DEFAULT_POLICY) -> None:
        """Register a model. `limit` > 0 (the server's per-key model limit) and the tier's `max_training_runs`
        > 0 cap active models per tenant, atomically across replicas; the smaller one wins. Reaching the
        server's limit is LimitExceeded (429, retried by the SDK), the tier's QuotaExceeded (403)."""
        owner_models = self.keys.owner_models(record.owner)
        cap = combined_limit(limit, policy.max_training_runs)
        if cap > 0:
            added = await self.r.eval(_ADD_WITH_LIMIT, 1, owner_models, record.model_id, cap)
            if not added:
                if cap == policy.max_training_runs:
                    raise training_runs_exceeded(policy, max(cap, int(await self.r.scard(owner_models))))
                raise LimitExceeded(f"This API key already has {limit} active models (the server's limit).",
                                    hint="Unload a model or let an idle one expire, then retry.")
        else:
            await self.r.sadd(owner_models, record.model_id)
        pipe = self.r.pipeline()
        pipe.hset(self.keys.model(record.model_id), mapping=record.to_hash())
        pipe.sadd(self.keys.owner_runs(record.owner), record.model_id)
        pipe.sadd(self.keys.pool_assigned(record.queue), record.model_id)
        await pipe.execute()

    async def _refused_model(self, answer: str, model_id: str, owner: str) -> None:
        """Raise what reading the model would have raised, when a submit that checked its model was refused."""
        if answer not in (lifecycle.MODEL_MISSING, lifecycle.MODEL_UNLOADED):
            return
        self._submitting.pop(model_id)
        await self.model(model_id, owner)  # raises NotFound or AdapterGone with the record's own details
        raise AdapterGone(f"Model {model_id} was unloaded.", hint="Create a new model.")  # changed back meanwhile

    async def model_to_submit(self, model_id: str, owner: str) -> ModelRecord:
        """The caller's active model, for a submit that checks its status in its own script (`check_model`).

        Read once and then kept: what a submit uses of it (owner, queue, base model, mode) never changes, and its
        status, which does, is the submit script's to check. So the ops every training step sends cost one round
        trip, not two."""
        record = self._submitting.get(model_id)
        if record is not None and record.owner == owner:
            return record
        record = await self.model(model_id, owner)
        self._submitting.put(model_id, record)
        return record

    async def model(self, model_id: str, owner: str, *, active: bool = True) -> ModelRecord:
        raw = await self.r.hgetall(self.keys.model(model_id))
        # A hash without its identity fields is the residue of late writes (a worker's op counter, a
        # submit's timestamp) to a record that was deleted meanwhile: the model is gone.
        record = ModelRecord.from_hash(raw) if raw and (b"owner" in raw or "owner" in raw) else None
        if record is None or record.owner != owner:
            raise NotFound(f"Model {model_id} not found.", hint="Create a training client first.")
        if active and record.status != "active":
            raise AdapterGone(f"Model {model_id} was unloaded ({record.unload_reason or 'unloaded'}).",
                              hint=f"Create a new model; its last checkpoint was {record.last_checkpoint or 'none'}.")
        return record

    async def release_model(self, record: ModelRecord, *, reason: str) -> None:
        """Mark a model unloaded and free its place in the owner's model limit."""
        pipe = self.r.pipeline()
        pipe.hset(self.keys.model(record.model_id), mapping={"status": "unloaded", "unload_reason": reason})
        pipe.srem(self.keys.owner_models(record.owner), record.model_id)
        pipe.srem(self.keys.pool_assigned(record.queue), record.model_id)
        await pipe.execute()

    async def session_models(self, session_id: str, owner: str) -> list[ModelRecord]:
        """The owner's active models created in this session."""
        ids = sorted(m.decode() if isinstance(m, bytes) else m
                     for m in await self.r.smembers(self.keys.owner_models(owner)))
        pipe = self.r.pipeline(transaction=False)
        for model_id in ids:
            pipe.hgetall(self.keys.model(model_id))
        records = [ModelRecord.from_hash(raw) for raw in await pipe.execute() if raw]
        return [m for m in records if m.session_id == session_id and m.owner == owner and m.status == "active"]

    async def next_model_seq(self, session_id: str) -> int:
        return int(await self.r.hincrby(self.keys.session(session_id), "model_seq", 1)) - 1

    async def list_runs(self, owner: str) -> list[ModelRecord]:
        ids = await self.r.smembers(self.keys.owner_runs(owner))
        pipe = self.r.pipeline()
        for model_id in ids:
            pipe.hgetall(self.keys.model(model_id.decode() if isinstance(model_id, bytes) else model_id))
        records = [ModelRecord.from_hash(raw) for raw in await pipe.execute() if raw]
        return sorted(records, key=lambda m: m.created_at, reverse=True)

    async def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        raw = await self.r.hgetall(self.keys.checkpoints(run_id))
        entries = [json.loads(v) for v in raw.values()]
        return sorted(entries, key=lambda c: c["time"])

    # -- sampling sessions ---------------------------------------------------------------------

    async def add_sampling_session(self, record: SamplingSessionRecord) -> None:
        pipe = self.r.pipeline()
        pipe.hset(self.keys.sampling_session(record.sampling_session_id), mapping=record.to_hash())
        pipe.sadd(self.keys.owner_sampling_sessions(record.owner), record.sampling_session_id)
        await pipe.execute()

    async def sampling_session(self, sampling_session_id: str, owner: str) -> SamplingSessionRecord:
        """The caller's sampling session. Read once and then kept, as `model_to_submit` keeps a model: a sampling
        session's record never changes and is never deleted, so every sample of a client costs one round trip."""
        record = self._sampling_sessions.get(sampling_session_id)
        if record is None:
            raw = await self.r.hgetall(self.keys.sampling_session(sampling_session_id))
            record = SamplingSessionRecord.from_hash(raw) if raw else None
            if record is not None:
                self._sampling_sessions.put(sampling_session_id, record)
        if record is None or record.owner != owner:
            raise NotFound(f"Sampling session {sampling_session_id} not found.",
                           hint="Create a sampling client first.")
        return record

    # -- runs' records and checkpoint indexes, beyond the owner's view -------------------------

    async def model_record(self, model_id: str) -> ModelRecord | None:
        """The model's record, whoever owns it; None when there is none."""
        raw = await self.r.hgetall(self.keys.model(model_id))
        return ModelRecord.from_hash(raw) if raw else None

    async def checkpoint_entry(self, run_id: str, checkpoint_id: str) -> dict[str, Any] | None:
        raw = await self.r.hget(self.keys.checkpoints(run_id), checkpoint_id)
        if raw is None:
            return None
        entry: dict[str, Any] = json.loads(raw)
        return entry

    async def put_checkpoint_entry(self, run_id: str, checkpoint_id: str, entry: dict[str, Any]) -> None:
        await self.r.hset(self.keys.checkpoints(run_id), checkpoint_id, json.dumps(entry))

    async def delete_checkpoint_entry(self, run_id: str, checkpoint_id: str) -> None:
        await self.r.hdel(self.keys.checkpoints(run_id), checkpoint_id)

    async def add_unloaded_run(self, run: ModelRecord, entries: dict[str, dict[str, Any]], *,
                               answer: tuple[str, str, int] | None = None) -> None:
        """A run made of checkpoints (a copy, an import) with their index entries, in one transaction: listed
        among its owner's runs, it never holds a LoRA slot. `answer` (key, value, seconds) is an idempotency
        key set along with it."""
        pipe = self.r.pipeline()
        pipe.hset(self.keys.model(run.model_id), mapping=run.to_hash())
        pipe.sadd(self.keys.owner_runs(run.owner), run.model_id)
        for checkpoint_id, entry in entries.items():
            pipe.hset(self.keys.checkpoints(run.model_id), checkpoint_id, json.dumps(entry))
        if answer is not None:
            key, value, seconds = answer
            pipe.set(key, value, ex=seconds)
        await pipe.execute()

    async def idempotent_answer(self, key: str) -> str | None:
        """What an earlier call with this idempotency key answered, if it is still kept."""
        done = await self.r.get(key)
        return None if not done else done.decode() if isinstance(done, bytes) else str(done)

    async def forget_failed_dedupe(self, scope: str, seq_id: int) -> None:
        """Drop the dedupe record of (scope, seq_id) when its future failed or is gone, so the next submit with
        them runs the op again instead of answering that future."""
        key = self.keys.dedupe(scope, seq_id)
        previous = await self.r.get(key)
        if previous is None:
            return
        status = await self.r.hget(self.keys.future(previous.decode() if isinstance(previous, bytes)
                                                    else str(previous)), "status")
        if status is None or (status.decode() if isinstance(status, bytes) else str(status)) == FutureStatus.FAILED:
            await self.r.delete(key)

    # -- what the console shows -----------------------------------------------------------------

    async def owner_records(self, owner: str, latest_ops: int) -> tuple[
            list[SessionRecord], list[SamplingSessionRecord], list[FutureRecord]]:
        """The records listed under the owner (its sessions, its sampling sessions, its latest `latest_ops`
        requests, newest first), as stored: each one's owner is for the caller to check."""
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(self.keys.owner_sessions(owner))
        pipe.smembers(self.keys.owner_sampling_sessions(owner))
        pipe.zrevrange(self.keys.owner_futures(owner), 0, latest_ops - 1)
        sessions, sampling, latest = await pipe.execute()
        session_ids, sampling_ids = sorted(text(s) for s in sessions), sorted(text(s) for s in sampling)
        request_ids = [text(x) for x in latest]
        for sid in session_ids:
            pipe.hgetall(self.keys.session(sid))
        for sid in sampling_ids:
            pipe.hgetall(self.keys.sampling_session(sid))
        for rid in request_ids:
            pipe.hgetall(self.keys.future(rid))
        replies = await pipe.execute()
        sampling_end = len(session_ids) + len(sampling_ids)
        return ([SessionRecord.from_hash(h) for h in replies[: len(session_ids)] if h],
                [SamplingSessionRecord.from_hash(h) for h in replies[len(session_ids) : sampling_end] if h],
                [FutureRecord.from_hash(h) for h in replies[sampling_end:] if h])  # expired ones are gone

    async def run_metrics(self, run_id: str) -> list[Any]:
        """The run's metric entries as its pool appended them (twinkle.run_metrics)."""
        return list(await self.r.lrange(self.keys.run_metrics(run_id), 0, -1))

    async def recent_errors(self, limit: int) -> list[dict[str, Any]]:
        return [json.loads(e) for e in await self.r.lrange(self.keys.recent_errors(), 0, limit - 1)]

    # -- the connection -------------------------------------------------------------------------

    async def ping(self) -> None:
        await self.r.ping()

    async def subscription(self, channel: str) -> aioredis.client.PubSub:
        """A pub/sub connection of its own, subscribed to `channel`; the caller closes it."""
        pubsub = self.r.pubsub()
        await pubsub.subscribe(channel)
        return pubsub

    async def close(self) -> None:
        await self.r.aclose()



# SADD only while the set is below the limit, as one atomic step on the Redis server.
_ADD_WITH_LIMIT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
"""
