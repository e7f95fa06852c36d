"""Names shared by every signal Twinkle emits: deployments, span names, attribute keys, metric names.

A deployment is the kind of component that did the work, as the seed's dashboard groups it: the API
(`Gateway`) and the three kinds of pool (`Model`, `Sampler`, `Processor`).
"""

from __future__ import annotations

from typing import Literal

GATEWAY, MODEL, SAMPLER, PROCESSOR = "Gateway", "Model", "Sampler", "Processor"
DEPLOYMENTS = (GATEWAY, MODEL, SAMPLER, PROCESSOR)

# span attributes
SESSION_ID = "twinkle.session_id"
MODEL_ID = "twinkle.model_id"
TASK_TYPE = "twinkle.task_type"
REQUEST_ID = "twinkle.request_id"
TENANT = "twinkle.tenant"
QUEUE = "twinkle.queue"
DEPLOYMENT = "twinkle.deployment"
SUBMIT_TRACE_ID = "twinkle.submit_trace_id"
ERROR_CATEGORY = "twinkle.error.category"

InstrumentKind = Literal["counter", "histogram", "gauge"]

# The seed's metric names ("指标命名参考") plus the per-model token counters, with their instrument kinds.
METRICS: dict[str, InstrumentKind] = {
    "twinkle.http.requests.total": "counter",
    "twinkle.http.request.duration_seconds": "histogram",
    "twinkle.queue.depth": "gauge",
    "twinkle.task.execution_seconds": "histogram",
    "twinkle.task.wait_seconds": "histogram",
    "twinkle.rate_limit.rejections.total": "counter",
    "twinkle.tasks.total": "counter",
    "twinkle.sessions.active": "gauge",
    "twinkle.models.active": "gauge",
    "twinkle.sampling_sessions.active": "gauge",
    "twinkle.futures.active": "gauge",
    "twinkle.tokens.trained": "counter",
    "twinkle.tokens.sampled": "counter",
}


# Exact usage (twinkle/usage.py): one counter per metered quantity, `twinkle.usage.<metric>`, by tenant, model and
# task type, counted when the pool's ledger counts the op. Not in METRICS above, which lists what every run
# exports (a run that saves nothing counts no checkpoint bytes).
USAGE_PREFIX = "twinkle.usage."


def usage_metric(metric: str) -> str:
    """The counter of one metered quantity (`trained_tokens` -> `twinkle.usage.trained_tokens`)."""
    return USAGE_PREFIX + metric


def span_name(deployment: str) -> str:
    return f"twinkle.server.{deployment}"


def deployment_of_queue(queue: str) -> str:
    """The deployment a pool queue (`model.<app>.<replica>`, `sampler.<app>`, `processor.<app>`) belongs to."""
    kind = queue.partition(".")[0]
    return {"model": MODEL, "sampler": SAMPLER, "processor": PROCESSOR}.get(kind, GATEWAY)


def session_of(resource_id: str) -> str:
    """The session a model (`<session>:train:<n>`) or sampling session (`<session>:sample:<n>`) belongs to."""
    for marker in (":train:", ":sample:"):
        session, found, _ = resource_id.partition(marker)
        if found:
            return session
    return ""


def prometheus_name(name: str, kind: InstrumentKind) -> str:
    """The name Prometheus' OTLP receiver gives a metric: dots become underscores, monotonic counters end
    in `_total` (once), histograms are queried through their `_bucket` series."""
    flat = name.replace(".", "_")
    if kind == "counter" and not flat.endswith("_total"):
        flat += "_total"
    return flat


def op_attributes(request_id: str, op: str, resource_id: str, queue: str) -> dict[str, str]:
    """Span attributes naming one op: its request id, verb, queue, and the model and session it serves."""
    attributes = {REQUEST_ID: request_id, TASK_TYPE: op, QUEUE: queue}
    session = session_of(resource_id)
    if session:
        attributes[SESSION_ID] = session
    if ":train:" in resource_id:
        attributes[MODEL_ID] = resource_id
    return attributes
