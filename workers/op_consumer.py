"""A model pool's consumer of its own queue: it pops each op's message, records it as delivered and runs the op,
all on the pool's one thread, where Celery's consumer would hand each message through its event loop, kombu's
virtual transport and a thread of the pool.

A model pool runs one op at a time and its ops are two ids each (workers/lean_tasks.py), so Celery's consumer
only carried the messages: on the Tinker SDK path its event loop, kombu's delivery and the hand-off to the pool's
thread cost about 12 % of the pool worker's CPU a step (the README's Benchmarks, eighth pass). Here a message
costs a pop and one round trip that records it and reads what its op needs (workers/prereads.py).

What it keeps of Celery's consumer and workers/handover.py:
- A message is always in the queue, its handover list or `unacked`: BLMOVE into the handover list, then one
  script records it under kombu's own keys (`messages.record_delivery`, retried across a broker restart). What a
  lost connection left in the handover list goes back to the head of the queue before the next pop.
- The request ids it holds (popped, not yet acked) are what the heartbeat publishes for the orphan sweep and the
  lost-futures check (`held`).
- A completed op's finish acknowledges its message (the tag in `acked_by_finish`); any other outcome is acked
  after the op, as Celery's request would. An ack the broker cannot take leaves the message to the orphan sweep,
  whose redelivery finds the future terminal.
- A broker outage: pops are tried again every 0.2-1 s; the ops already held still run (their own writes ride out
  a restart).
- Warm shutdown on SIGTERM or SIGINT: the running op finishes, and the held ones go back to the head of the queue
  in their order; a second signal exits at once (the launcher puts back what the pool held before its restart).

Fair share (`turns`): it holds up to `window` messages, popping while the queue has more, and runs the one
`FairTurns` picks. `fifo`: one message at a time, in queue order. Unlike Celery's prefetch it takes nothing while
an op runs: what arrives meanwhile waits in the queue (where a crash or a frozen worker leaves it anyway), and
the window is filled again before each pick, so the pick sees it.

A pool whose tasks something watches (Flower, telemetry, `launch -v`) or that runs clock cycles keeps Celery's
consumer (workers/pool.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis

from twinkle.ledger import SyncLedger, messages
from twinkle.task_message import envelope_op
from workers.fair_turns import FairTurns, Turn
from workers.handover import retrying_record
from workers.prereads import Prereads

log = logging.getLogger("twinkle.worker")

POP_SECONDS = 1  # a blocking pop's longest wait: how soon a stop is noticed while the queue is empty
RETRY_PAUSES = (0.2, 0.4, 0.6, 0.8, 1.0)  # between pops while the broker is away, then 1 s each

# request id, model id, delivery tag
OpRunner = Callable[[str, str, str], None]


@dataclass(frozen=True)
class Held:
    """A message this consumer popped and recorded, whose op has not finished."""

    request_id: str
    model_id: str
    message: dict[str, Any]  # as the queue held it
    run: OpRunner


class OpConsumer:
    def __init__(self, client: redis.Redis, queue: str, runners: dict[str, OpRunner], *,
                 acked_by_finish: set[str], prereads: Prereads, turns: FairTurns | None = None,
                 window: int = 1) -> None:
        self.client = client  # its own connection: a blocking pop must not hold one another thread needs
        self.queue = queue
        self.runners = runners  # by task name
        self.acked_by_finish = acked_by_finish
        self.prereads = prereads
        self.turns = turns
        self.window = max(1, window) if turns is not None else 1
        self.ledger = SyncLedger(client)
        self._held: dict[str, Held] = {}  # by delivery tag, in delivery order
        self._lock = threading.Lock()  # the heartbeat's thread reads the held ids
        self._returned = False  # what a lost connection left in the handover list is back in the queue
        self._outage = 0  # pops failed in a row
        self.stopping = False

    def held(self) -> set[str]:
        """Request ids of the messages this process holds (popped, not yet acked)."""
        with self._lock:
            return {held.request_id for held in self._held.values()}

    def run(self) -> None:
        """Consume until stopped (`stop`, or a signal after `stop_on_signals`), then put back what is held."""
        log.info("pool %s: consuming (%s)", self.queue, "fair share" if self.turns is not None else "fifo")
        while not self.stopping:
            self._fill()
            if self._held and not self.stopping:
                self._run_next()
        self._put_back()

    def stop(self) -> None:
        """Stop after the running op (a warm shutdown)."""
        self.stopping = True

    # -- popping --------------------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Pop and record messages: with none held, wait for one; with some held, take more while the queue has
        them and the window allows."""
        waiting: int | None = None
        try:
            if not self._returned:
                self.ledger.run(messages.return_handover(self.queue))
                self._returned = True
            while len(self._held) < self.window and waiting != 0 and not self.stopping:
                if self._held:
                    item = self.client.lmove(self.queue, messages.handover_key(self.queue), "RIGHT", "LEFT")
                else:
                    item = self.client.blmove(self.queue, messages.handover_key(self.queue), POP_SECONDS,
                                              "RIGHT", "LEFT")
                if item is None:
                    break
                waiting = self._take(item.encode() if isinstance(item, str) else item)
        except redis.RedisError as error:  # unreachable, or loading its data after a restart
            self._returned = False
            self._outage += 1
            if self._outage == 1:
                log.warning("pool %s: the broker failed a pop (%s: %s); trying again", self.queue,
                            type(error).__name__, error)
            if not self._held:  # else the held ops run meanwhile
                time.sleep(RETRY_PAUSES[min(self._outage, len(RETRY_PAUSES)) - 1])
            return
        if self._outage:
            log.info("pool %s: the broker is back", self.queue)
            self._outage = 0

    def _take(self, item: bytes) -> int:
        """Record a popped message as delivered, with its op's read; how many wait in the queue behind it."""
        op = envelope_op(item)
        message, task, request_id, model_id = op if op is not None else ({}, "", "", "")
        tag = str(message.get("properties", {}).get("delivery_tag", ""))
        run = self.runners.get(task)
        if not tag or not request_id or run is None:
            log.error("pool %s: dropped a message that is not a Twinkle op: %.200r", self.queue, item)
            self.ledger.run(messages.drop_handed(self.queue, item))
            return -1
        delivery = message["properties"].get("delivery_info") or {}
        recorded = messages.record_delivery(
            self.queue, tag,
            messages.entry(item, str(delivery.get("exchange", "")), str(delivery.get("routing_key", self.queue))),
            item)
        with self._lock:  # held before it is recorded: the orphan sweep never sees it recorded and not held
            self._held[tag] = Held(request_id, model_id, message, run)
        try:
            read = self.prereads.read(request_id, model_id)
            waiting, inputs = retrying_record(lambda: self.ledger.run_then(recorded, read))
        except BaseException:
            with self._lock:
                del self._held[tag]
            raise
        if not isinstance(inputs, Exception):  # else the op reads for itself
            self.prereads.keep(request_id, model_id, inputs)
        if self.turns is not None:
            self.turns.offer(Turn(partial(self._run_held, tag), request_id, model_id))
        return waiting

    # -- running --------------------------------------------------------------------------------------------

    def _run_next(self) -> None:
        if self.turns is not None:
            self.turns.next().run()
        else:
            self._run_held(next(iter(self._held)))

    def _run_held(self, tag: str) -> None:
        held = self._held[tag]
        try:
            held.run(held.request_id, held.model_id, tag)
        except Exception:  # PoolRuntime.execute fails the op itself: this is a bug, acked as Celery acks it
            log.exception("op %s raised out of its runner", held.request_id)
        finally:
            self._ack(tag)
            with self._lock:
                del self._held[tag]

    def _ack(self, tag: str) -> None:
        if tag in self.acked_by_finish:
            self.acked_by_finish.discard(tag)
            return
        try:
            self.ledger.run(messages.ack(tag))
        except redis.RedisError as error:
            log.warning("ack of %s dropped (%s); it is redelivered and ignored once the broker is back", tag, error)

    # -- stopping -------------------------------------------------------------------------------------------

    def stop_on_signals(self) -> None:
        """SIGTERM and SIGINT stop it after the running op; a second one exits at once (the main thread)."""

        def warm(signum: int, _frame: Any) -> None:
            if self.stopping:
                log.warning("pool %s: stopping now (%s again)", self.queue, signal.Signals(signum).name)
                os._exit(1)  # what it holds stays unacked; the launcher puts it back before the restart
            log.info("pool %s: stopping after the running op (%s)", self.queue, signal.Signals(signum).name)
            self.stop()

        signal.signal(signal.SIGTERM, warm)
        signal.signal(signal.SIGINT, warm)

    def _put_back(self) -> None:
        """The held messages, back at the head of the queue in their order (newest pushed first)."""
        with self._lock:
            held = list(self._held.items())
        for tag, message in reversed(held):
            found = messages.Delivery(tag, message.message, self.queue)
            try:
                self.ledger.run(messages.restore_orphan(found, self.queue))
            except redis.RedisError:
                log.warning("pool %s: %s not put back (the broker is away); the next worker's start does it",
                            self.queue, message.request_id)
        if held:
            log.info("pool %s: put %d held message(s) back", self.queue, len(held))

