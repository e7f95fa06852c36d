"""A pool's op tasks without Celery's per-task machinery, where nothing watches it.

Celery hands each message to its task's strategy (`celery.worker.strategy.default`), which builds a Request,
sends the task-received signal, reserves it in the worker's state and sends it to the pool, where the tracer
decodes the body again, pushes the task's context, sends the prerun, postrun and success signals and checks the
result backend, before the request acks the message. A Twinkle op needs none of it: its arguments are two ids,
its outcome is its future record, and a completed op's finish already acknowledged its message in the broker
(workers/handover.py). So a message goes from the consumer straight to the same pool of threads, and is acked
through the same call Celery's request would make.

What still needs Celery's path keeps it: a server with Flower (task events) or telemetry (Celery's signals,
twinkle/telemetry/celery_tracing.py), or launched with `-v` (Celery's per-task log lines), registers the tasks
without this strategy, and a message this strategy does not expect (an ETA, an expiry, a revoked id, any other
body) goes to Celery's own.

The ack itself is made in the op's thread, as the same `ack_log_error` call Celery's promise would make in the
consumer's event loop: sent there, each op woke the loop once more only to mark its message acked in memory (its
finish already acknowledged it in the broker), a turn of the loop per op. The loop is woken only when it may have
stopped fetching at its prefetch limit (`_ack_here`), and Celery's own promise still acks while Celery restores its
prefetch count after a reconnect, which it does one ack at a time through that promise.

A model pool without clock cycles takes its messages with a consumer of its own (workers/op_consumer.py), which
calls the same runners; this strategy serves sampler pools and pools that run clock cycles.

Everything else is unchanged: the consumer, kombu's transport and prefetch, the threads (`-c`), and warm
shutdown (the pool's executor finishes what it holds).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery.worker.strategy import default

from twinkle.task_message import op_ids
from workers.handover import HandoverQoS

log = logging.getLogger("twinkle.worker")

# request_id, model_id, delivery tag
OpRunner = Callable[[str, str, str], None]


class LeanTasks:
    """The strategy of a pool's op tasks (Celery's `Task.Strategy`), and the ids of the messages it holds."""

    def __init__(self, received: Callable[[str, str], None] | None = None) -> None:
        self.received = received  # told of each message in delivery order, before its thread starts
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._acking = threading.Lock()  # one ack at a time: exactly the one that frees a slot at the limit wakes
        self.runners: dict[str, OpRunner] = {}  # by task name (a model pool's own consumer runs them too)

    @staticmethod
    def wanted(*, watched: bool, threads: bool) -> bool:
        """Whether a pool takes its messages this way: not where anything watches Celery's task layer (Flower,
        telemetry, `launch -v`), and only in a pool of threads (a prefork pool's children run Celery's own)."""
        return threads and not watched

    def held(self) -> set[str]:
        """Request ids of the messages this process holds (delivered, not yet acked)."""
        with self._lock:
            return set(self._held)

    def strategy(self, task: Any, app: Any, consumer: Any, **options: Any) -> Callable[..., Any]:
        """Celery builds this once per task when its consumer starts; the handler runs in the consumer's loop."""
        celerys = default(task, app, consumer, **options)
        run = self.runners[task.name]
        submit = consumer.pool.executor.submit  # the threads pool's executor (`-P threads`)
        revoked = consumer.controller.state.revoked
        errors = consumer.connection_errors

        def handle(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
            ids = _ids(message, body, revoked)
            if ids is None:
                return celerys(message, body, ack, reject, callbacks)
            request_id, model_id = ids
            with self._lock:
                self._held.add(request_id)
            if self.received is not None:
                self.received(request_id, model_id)
            tag = str(message.properties.get("delivery_tag", ""))
            qos = getattr(message.channel, "qos", None)
            if isinstance(qos, HandoverQoS) and consumer.hub is not None and not _restoring_prefetch(consumer):
                def acked() -> None:
                    self._ack_here(message, qos, errors, consumer.hub)
            else:
                def acked() -> None:
                    ack(log, errors)
            try:
                submit(self._run, run, request_id, model_id, tag, acked)
            except RuntimeError:  # the pool is shutting down: the message stays unacked and is put back
                with self._lock:
                    self._held.discard(request_id)
                log.warning("op %s not started: the pool is stopping; its message goes back to the queue",
                            request_id)
            return None

        return handle

    def _run(self, run: OpRunner, request_id: str, model_id: str, tag: str, ack: Callable[[], Any]) -> None:
        try:
            run(request_id, model_id, tag)
        except Exception:  # PoolRuntime.execute fails the op itself: this is a bug, acked as Celery acks it
            log.exception("op %s raised out of its runner", request_id)
        finally:
            with self._lock:
                self._held.discard(request_id)
            ack()

    def _ack_here(self, message: Any, qos: HandoverQoS, errors: Any, hub: Any) -> None:
        """Ack in this thread. The consumer stops fetching while its messages in hand reach the prefetch limit and
        looks again only when its loop turns, so the ack that frees a slot at the limit wakes it; counting, the ack
        can only overcount (HandoverQoS.in_hand), so a doubtful count wakes it too."""
        with self._acking:
            message.ack_log_error(log, errors)
            limit = qos.prefetch_count
            at_limit = bool(limit) and qos.in_hand() >= limit - 1
        if at_limit:
            hub.call_soon(_look_again)


def _look_again() -> None:
    """A turn of the consumer's loop, in which it checks its prefetch limit and fetches again."""


def _restoring_prefetch(consumer: Any) -> bool:
    """Whether Celery is restoring its prefetch count after a reconnect, which it does one ack at a time through
    its ack promise (`Consumer.create_task_handler`). Where Celery no longer says, assume so."""
    return getattr(consumer, "restart_count", 1) > 0 and not getattr(consumer, "_maximum_prefetch_restored", False)


def _ids(message: Any, body: Any, revoked: Any) -> tuple[str, str] | None:
    """The request and model ids of a plain op message (protocol 2, no ETA or expiry, not revoked); None for
    anything Celery's own strategy should handle."""
    headers = message.headers
    if body is not None or not isinstance(headers, dict) or headers.get("eta") or headers.get("expires"):
        return None
    if headers.get("id") in revoked:
        return None
    return op_ids(message)
