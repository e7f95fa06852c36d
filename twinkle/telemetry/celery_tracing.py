"""Trace context through Celery: the API's publish and the worker's execution join the request's trace.

CeleryInstrumentor injects the context into the message headers when a task is published
(`before_task_publish`) and continues it when a worker runs the task (`task_prerun`). It must be active in
both processes; workers on the threads pool never receive `worker_process_init`, so they instrument when
they start (docs/celery_notes.md#tracing-through-celery).
"""

from __future__ import annotations

from twinkle.telemetry.pipeline import Pipeline


def instrument_celery(pipeline: Pipeline) -> None:
    def instrument() -> bool:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.metrics import NoOpMeterProvider

        instrumentor = CeleryInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:  # an earlier pipeline of this process (tests)
            instrumentor.uninstrument()
        # Its own task-runtime histogram duplicates twinkle.task.execution_seconds: keep it off.
        instrumentor.instrument(tracer_provider=pipeline.tracer_provider, meter_provider=NoOpMeterProvider())
        return True

    pipeline.once("celery", instrument)
