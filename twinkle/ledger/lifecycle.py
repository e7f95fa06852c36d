"""One future's lifecycle: every state it moves through, and every read of its record.

The API submits a future (`queued`), or withdraws the submit when the job queue is unreachable; the worker that runs
the op begins it (`running`) and finishes it (`completed` or `failed`); the hang watch fails an op whose worker hung
(`fail_if_pending`), and the API's lost-request check adopts a record into a restarted broker or fails it as lost.
Each is one call (twinkle.ledger.call): the faces run it, the answer is decoded here.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from twinkle.backlog import MIN_SHARE
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.ledger import scripts
from twinkle.ledger.call import Arg, Call, commands, script, text
from twinkle.ledger.messages import UNACKED, UNACKED_INDEX

TERMINAL = (FutureStatus.COMPLETED.value.encode(), FutureStatus.FAILED.value.encode())


class Refused(IntEnum):
    """Why `begin` or `finish` wrote nothing."""

    GONE = -1  # the record vanished: a broker restarted without persistence lost it
    FENCED_OFF = -2  # another worker took the pool's lease (twinkle/pool_lease.py)
    ALREADY_ENDED = -3  # begin only: a sweep failed the op after the pool last read it


@dataclass(frozen=True)
class RunInputs:
    """What a pool reads before it runs an op: the record, its payload, and the model its message named."""

    record: FutureRecord | None
    payload: bytes | None
    model: dict[Any, Any]  # empty when the message named none


@dataclass(frozen=True)
class Running:
    """A record marked running: its op and when it began (epoch seconds)."""

    op: str
    started_at: float


# -- the API's side ------------------------------------------------------------------------------------------


MODEL_MISSING = "!missing"  # what a submit that checks its model answers for none, or another owner's
MODEL_UNLOADED = "!unloaded"  # ... for the owner's model that is no longer active


def _submitted(keys: Keys, record: FutureRecord, payload: bytes, dedupe_key: str, ttl: int, check_model: bool
               ) -> tuple[list[str], list[Arg]]:
    rid = record.request_id
    fields = [str(x) for kv in record.to_hash().items() for x in kv]
    return ([dedupe_key or keys.future(rid), keys.queue_tickets(record.queue), keys.future(rid), keys.blob_in(rid),
             keys.model(record.model_id) if record.model_id else "", keys.owner_futures(record.owner)],
            [rid, ttl, payload, time.time(), int(bool(dedupe_key)), record.owner if check_model else "", *fields])


def submit(keys: Keys, record: FutureRecord, payload: bytes, *, dedupe_key: str, ttl: int,
           check_model: bool = False) -> Call[str]:
    """Store the payload and the queued record, and take a queue ticket. Answers the request id that owns the
    future: the record's, or the first submit's where `dedupe_key` ('' = none) names a retried one. With
    `check_model`, nothing is stored unless the record's model is its owner's active one: MODEL_MISSING or
    MODEL_UNLOADED instead."""
    submit_keys, submit_args = _submitted(keys, record, payload, dedupe_key, ttl, check_model)
    return script(scripts.SUBMIT, submit_keys, submit_args, text)


def submit_and_send(keys: Keys, record: FutureRecord, payload: bytes, *, dedupe_key: str, ttl: int,
                    backlog: Sequence[str], window: int, message: str, check_model: bool = False) -> Call[str]:
    """`submit`, the key's admission into its pool's queue (twinkle.backlog: `backlog` are its KEYS, `window` the
    pool's) and, when admitted, the op's broker `message` pushed on the queue, all in one script."""
    submit_keys, submit_args = _submitted(keys, record, payload, dedupe_key, ttl, check_model)
    return script(scripts.SUBMIT_AND_SEND, [*submit_keys, *backlog, record.queue],
                  [len(submit_args), *submit_args, record.owner, record.request_id, record.op, record.model_id,
                   window, MIN_SHARE, ttl, time.time(), message], text)


def withdraw(keys: Keys, request_id: str, *, sent_key: str, dedupe_key: str) -> Call[None]:
    """Undo a submit whose message could not be sent: the record, its payload, its place among its key's sent
    ops (`sent_key`, twinkle.backlog) and its dedupe record ('' = none)."""
    sent: list[tuple[Arg, ...]] = [("DEL", keys.future(request_id), keys.blob_in(request_id)),
                                   ("ZREM", sent_key, request_id)]
    if dedupe_key:
        sent.append(("DEL", dedupe_key))
    return commands(*sent, decode=lambda _: None)


def read(keys: Keys, request_id: str) -> Call[FutureRecord | None]:
    return commands(("HGETALL", keys.future(request_id)),
                    decode=lambda replies: FutureRecord.from_hash(replies[0]) if replies[0] else None)


def read_with_result(keys: Keys, request_id: str) -> Call[tuple[FutureRecord | None, bytes | None]]:
    """The record and, in the same round trip, its result blob (None until it completed)."""
    return commands(("HGETALL", keys.future(request_id)), ("GET", keys.blob_out(request_id)),
                    decode=lambda replies: (FutureRecord.from_hash(replies[0]) if replies[0] else None, replies[1]))


def result(keys: Keys, request_id: str) -> Call[bytes | str | None]:
    return commands(("GET", keys.blob_out(request_id)), decode=lambda replies: replies[0])


def queue_position(keys: Keys, record: FutureRecord) -> Call[int]:
    """How many ops of its queue are ahead of a queued record (by the tickets the queue's worker started)."""
    return commands(("GET", keys.queue_started(record.queue)),
                    decode=lambda replies: max(0, record.ticket - int(replies[0] or 0) - 1))


def to_wake(keys: Keys, request_ids: Sequence[str], run_id: str) -> Call[list[int]]:
    """The positions in `request_ids` of the records that ended, vanished, or were written under a broker run
    other than `run_id` (the long-polls to wake: their own read decides what to answer)."""
    return script(scripts.TO_WAKE, [keys.future(rid) for rid in request_ids],
                  [run_id, FutureStatus.COMPLETED.value, FutureStatus.FAILED.value],
                  lambda reply: [int(index) - 1 for index in reply])


def adopt(keys: Keys, request_id: str, run_id: str) -> Call[None]:
    """A record whose message survived a broker restart takes the new broker's run_id (only an existing one)."""
    return script(scripts.ADOPT, [keys.future(request_id)], [run_id], lambda _: None)


def fail_if_unchanged(keys: Keys, record: FutureRecord, error: str, now: float) -> Call[bool]:
    """Fail a record as lost (`request_lost`) where its status and broker run_id are still the ones `record` read;
    wakes its long-polls. Whether it failed it."""
    return script(scripts.FAIL_IF_UNCHANGED, [keys.future(record.request_id)],
                  [record.status, record.broker_run_id, now, error, keys.done_channel(record.request_id)],
                  lambda reply: bool(int(reply)))


# -- the pool's side -----------------------------------------------------------------------------------------


def read_for_run(keys: Keys, request_id: str, model_id: str) -> Call[RunInputs]:
    """The record, its payload and the record of the model the op's message names ('' = none), in one round
    trip."""
    sent: list[tuple[Arg, ...]] = [("HGETALL", keys.future(request_id)), ("GET", keys.blob_in(request_id))]
    if model_id:
        sent.append(("HGETALL", keys.model(model_id)))

    def decode(replies: list[Any]) -> RunInputs:
        raw, payload, *named = replies
        return RunInputs(FutureRecord.from_hash(raw) if raw else None, payload, named[0] if named else {})

    return commands(*sent, decode=decode)


def begin(keys: Keys, record: FutureRecord, *, queue: str, fence_key: str = "", token: str = "",
          attempt: str = "") -> Call[int | Refused]:
    """Mark the op running, count it on its model and advance `queue`'s started ticket. Answers the op's index
    among its model's ops, or why it was not begun. `fence_key` and `token` are the pool lease's ('' = none);
    `attempt` names this try (the same attempt sent again answers what the first one got)."""
    return script(scripts.BEGIN, [keys.future(record.request_id), keys.model(record.model_id) if record.model_id
                                  else "", keys.queue_started(queue), fence_key],
                  [time.time(), record.ticket, token, attempt or _next_attempt()], _began)


# A try's name: random once per process, then counted, so no op pays uuid4's read of the OS's random source. The
# pid keeps forked children (which inherit the prefix and the count) apart.
_ATTEMPT_PREFIX = uuid.uuid4().hex[:16]
_attempts = itertools.count()


def _next_attempt() -> str:
    return f"{_ATTEMPT_PREFIX}-{os.getpid()}-{next(_attempts)}"


def _began(reply: Any) -> int | Refused:
    index = int(reply)
    return Refused(index) if index < 0 else index


def finish(keys: Keys, request_id: str, status: FutureStatus, result: bytes, *, ttl: int, fence_key: str = "",
           token: str = "", failure: dict[str, str] | None = None, finished_at: str = "",
           delivery_tag: str = "") -> Call[Refused | None]:
    """Write the outcome (`result` b'' = none; `failure` its error, category and code), drop the payload and wake
    the long-polls, only where the record still exists. None when written, else why not. `finished_at` (default:
    now) is what the record's field will read, so that a write sent along can tell this outcome was written. With
    the `delivery_tag` of the op's message, a written outcome acknowledges the message too (twinkle.ledger.messages);
    a refused one leaves it to the consumer's own ack."""
    fields = [str(x) for kv in {"status": status.value, "finished_at": finished_at or str(time.time()),
                                **(failure or {})}.items() for x in kv]
    inline = status is FutureStatus.COMPLETED and 0 < len(result) <= INLINE_RESULT_BYTES
    return script(scripts.FINISH, [keys.future(request_id), keys.blob_out(request_id), keys.blob_in(request_id),
                                   fence_key, UNACKED, UNACKED_INDEX],
                  [ttl, result, keys.done_channel(request_id), status.value, token, delivery_tag, int(inline),
                   *fields], _finished)


# A completed op's result up to this size goes with the message that wakes its long-polls, so the API answers a
# woken poll without reading it back. Every API process gets every done message: larger results are read.
INLINE_RESULT_BYTES = 32 * 1024
_WITH_RESULT = FutureStatus.COMPLETED.value.encode() + b"\n"


def done_result(message: bytes) -> bytes | None:
    """The result a future's done message carries (`finish` sends small ones along), or None: read it."""
    return message[len(_WITH_RESULT):] if message.startswith(_WITH_RESULT) else None


def append_run_metrics(keys: Keys, request_id: str, model_id: str, *, steps: bool, entry: str, max_entries: int,
                       finished_at: str = "") -> Call[int]:
    """Append a finished op's metrics entry to its run (twinkle.run_metrics); with `finished_at`, only where the
    op's record carries that finish time, so that a finish refused or written by another worker counts nothing.
    The step it counts toward, -1 when the model is gone, -2 when the finish was not that one."""
    return script(scripts.APPEND_RUN_METRICS,
                  [keys.model(model_id), keys.run_metrics(model_id), keys.future(request_id)],
                  [int(steps), entry, max_entries, finished_at], int)


def _finished(reply: Any) -> Refused | None:
    written = int(reply)
    return None if written == 1 else Refused.GONE if written == 0 else Refused(written)


def fail_if_pending(keys: Keys, request_id: str, error: str, code: str) -> Call[bool]:
    """Fail a record that is queued or running (server category); never creates one, never overwrites an outcome.
    Whether it failed it."""
    return script(scripts.FAIL_IF_PENDING, [keys.future(request_id)],
                  [time.time(), error, code, keys.done_channel(request_id)], lambda reply: bool(reply))


def ended(keys: Keys, request_id: str) -> Call[bool]:
    """Whether the record is terminal now."""
    return commands(("HGET", keys.future(request_id), "status"), decode=lambda replies: replies[0] in TERMINAL)


def running(keys: Keys, request_ids: Sequence[str]) -> Call[dict[str, Running]]:
    """Those of `request_ids` whose records say `running`, in their order, with their op and start time."""
    def decode(replies: list[Any]) -> dict[str, Running]:
        return {rid: Running(text(op) if op else "", float(started or 0))
                for rid, (status, started, op) in zip(request_ids, replies, strict=True)
                if status == FutureStatus.RUNNING.value.encode()}

    return commands(*[("HMGET", keys.future(rid), "status", "started_at", "op") for rid in request_ids],
                    decode=decode)
