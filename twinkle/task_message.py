"""The broker message of one op, as Celery's producer would push it onto a pool's queue, built without it.

`celery.send_task` is a blocking call (the API runs it in a thread), builds a Redis client per publish, and
costs the API a round trip of its own after the submit script's. The message itself is plain data: Celery's
task message (protocol 2, from Celery's own `as_task_v2`) inside the envelope kombu's Redis transport pushes
(`prepare_message`, `_inplace_augment_message`, `_put`: a JSON object whose body is base64, LPUSHed on the
queue's list for priority 0). Built here, it can be pushed by the submit script itself, in the same round trip
that writes the future (api/store.py). The worker consumes it like any other (tests/twinkle/test_task_message.py
compares it with what `send_task` pushes).

Publishing this way skips Celery's `before_task_publish` / `task-sent` hooks, so a server whose Flower or
OpenTelemetry needs them keeps `send_task` (`direct_send` in api/store.py).
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from celery import Celery

from twinkle.celery_app import task_name


def task_message(celery: Celery, op: str, request_id: str, model_id: str, queue: str) -> str:
    """The JSON kombu's Redis transport would LPUSH on `queue` for `send_task(task_name(op), kwargs=...,
    queue=queue, task_id=request_id)`."""
    kwargs = {"request_id": request_id, "model_id": model_id}
    # reply_to and ignore_result as send_task passes them; the reprs Celery would make with its slower saferepr,
    # which equals repr for two short ids
    task = celery.amqp.as_task_v2(request_id, task_name(op), kwargs=kwargs, reply_to=celery.thread_oid,
                                  ignore_result=None, argsrepr="()", kwargsrepr=repr(kwargs))
    body = json.dumps(task.body).encode()
    properties: dict[str, Any] = {
        **task.properties,
        "delivery_mode": 2,  # persistent, as kombu's producer marks every message of a durable queue
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    return json.dumps({
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": task.headers,
        "properties": properties,
    })


def op_ids(message: Any) -> tuple[str, str] | None:
    """The request and model ids a kombu message built by `task_message` carries in its kwargs; None for any
    other body (kombu keeps the decoded body, so asking again costs nothing)."""
    try:
        return _ids(*message.decode())
    except (ValueError, TypeError, KeyError):
        return None


def envelope_op(item: bytes) -> tuple[dict[str, Any], str, str, str] | None:
    """A queue item as `task_message` builds it, read without kombu: the envelope, its task's name, and the request
    and model ids; None for anything else (an ETA or an expiry included, which Twinkle never sends)."""
    try:
        envelope = json.loads(item)
        headers = envelope["headers"]
        if headers.get("eta") or headers.get("expires"):
            return None
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        ids = _ids(*json.loads(body))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return None if ids is None else (envelope, str(headers.get("task", "")), *ids)


def _ids(args: Any, kwargs: Any, _embed: Any) -> tuple[str, str] | None:
    """The ids of a protocol-2 body `[args, kwargs, embed]` with only the two id kwargs."""
    request_id, model_id = kwargs["request_id"], kwargs.get("model_id") or ""
    if args or not isinstance(request_id, str) or not isinstance(model_id, str):
        return None
    return request_id, model_id
