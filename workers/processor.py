"""The processor pool: CPU work clients offload, today `encode` (chat template + tokenization).

It runs as a prefork Celery worker with `ncpu_proc_per_node` processes, so the chunks of one remote
`Dataset.encode` run in parallel; each process keeps the templates it loaded.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from twinkle.futures import FutureRecord, Op

_templates: dict[str, Any] = {}


def _template(name: str, kwargs: dict[str, Any]) -> Any:
    from twinkle.template import get_template

    key = json.dumps([name, kwargs], sort_keys=True, default=str)
    if key not in _templates:
        _templates[key] = get_template(name, **kwargs)
    return _templates[key]


def _jsonable(feature: Any) -> dict[str, Any]:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in dict(feature).items()}


def encode(rec: FutureRecord, req: dict[str, Any]) -> dict[str, Any]:
    from twinkle.data_format import Trajectory

    template = _template(req["template"], req.get("template_kwargs") or {})
    trajectories = [Trajectory.model_validate(row) for row in req["rows"]]
    features = template.batch_encode(trajectories, add_generation_prompt=bool(req.get("add_generation_prompt")))
    return {"features": [_jsonable(f) for f in features]}


def handlers() -> dict[str, Any]:
    return {Op.ENCODE: encode}


def warm_up() -> None:
    """Import the tokenizer stack once in the parent, so every prefork child starts with it loaded."""
    import transformers  # noqa: F401

    import twinkle.data_format
    import twinkle.template  # noqa: F401
