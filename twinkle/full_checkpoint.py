"""What marks a checkpoint directory as a full-parameter one (a whole model, not a LoRA adapter).

A full run's `save_state` / `save_weights_for_sampler` writes a HuggingFace model directory (config.json,
sharded safetensors, tokenizer files) plus this marker; loaders read the marker to refuse a LoRA checkpoint
where a full one is needed and the other way round. Imports nothing heavy: the API and samplers read it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MARKER = "twinkle_full.json"
FORMAT = 1


def is_full_checkpoint(directory: Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def write_marker(directory: Path, **facts: Any) -> None:
    """`facts`: what a reader may want without loading the weights (base model, steps, with optimizer)."""
    (Path(directory) / MARKER).write_text(json.dumps({"format": FORMAT, **facts}, indent=1))


def read_marker(directory: Path) -> dict[str, Any]:
    return dict(json.loads((Path(directory) / MARKER).read_text()))
