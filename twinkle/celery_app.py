"""The Celery application shared by the API (producer only) and the pool workers.

Settings follow docs/celery_notes.md#worker-settings: late acks, prefetch 1 (model pools reserve one more, see
workers/pool.py), one consumer per queue, no retries or priorities on stateful ops, a visibility timeout
longer than any op, and no result backend (futures are Twinkle's own records in Redis).
"""

from __future__ import annotations

from celery import Celery

VISIBILITY_TIMEOUT = 6 * 3600


def task_name(op: str) -> str:
    return f"twinkle.{op}"


def make_celery(broker_url: str, *, key_prefix: str = "", events: bool = True) -> Celery:
    """`events` (task-sent/-received/-started/-succeeded messages) feed Flower; they cost a publish each,
    so servers without Flower turn them off."""
    app = Celery("twinkle", broker=broker_url, set_as_current=False)
    transport: dict[str, object] = {
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "socket_timeout": 30,
        "health_check_interval": 25,
    }
    if key_prefix:
        transport["global_keyprefix"] = key_prefix
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_reject_on_worker_lost=False,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options=transport,
        visibility_timeout=VISIBILITY_TIMEOUT,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_send_task_events=events,
        task_send_sent_event=events,
        worker_hijack_root_logger=False,
        task_create_missing_queues=True,
        broker_pool_limit=64,
    )
    return app
