"""JSON answers of the web console (api/console/routes.py); its pages are HTML."""

from __future__ import annotations

from pydantic import Field

from api.responses.answer import Answer


class RunMetrics(Answer):
    run_id: str
    steps: int = Field(description="Optimizer steps taken.")
    series: dict[str, list[tuple[int, float | None]]] = Field(
        description="Per metric, its [step, value] points (value null where it is not finite).")
