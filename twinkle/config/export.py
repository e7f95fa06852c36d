"""How a model pool makes merged exports (`export_merged`, twinkle.merged_export)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from twinkle.config.base import StrictModel, config_problem

_SIZE = re.compile(r"^\d+(KB|MB|GB|KiB|MiB|GiB)?$", re.IGNORECASE)  # what transformers' save_pretrained reads


class ExportConfig(StrictModel):
    """Merged exports: a checkpoint's LoRA merged into the base weights as a Hugging Face model directory, checked
    against the pool's own logprobs before it is offered (transformers backend)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the merged weights; `auto` keeps the dtype the base model is stored in. The merge itself runs in
    float32 on the CPU."""
    max_shard_size: str = "5GB"
    """Largest safetensors shard of a merged model (`5GB`, `500MB`, `2GiB`, a byte count); larger models are split into
    `model-0000i-of-0000n.safetensors` with an index."""
    tolerance: float = Field(default=1e-3, gt=0)
    """Largest absolute logprob difference on the probe batch, between an export loaded as a user loads it and
    the pool's forward of the same checkpoint, when both compute in float32; beyond it the export fails."""
    tolerance_16bit: float = Field(default=0.1, gt=0)
    """The same when the pool or the merged weights use a 16-bit dtype, whose rounding alone moves logprobs by
    about 1e-2 (such a check catches gross merge errors only)."""

    verify_adapter_exports: bool = True
    """Check every unencrypted `save_weights_external` the same way (the adapter files loaded with
    PeftModel.from_pretrained on a copy of the base model the pool loads for it) and record the difference in
    the checkpoint's listing; off for base models too large to load a second copy of on the CPU."""

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str) -> str:
        if not _SIZE.fullmatch(value.strip()):
            raise config_problem(f"{value!r} is not a size", hint="write it like 5GB, 500MB, 2GiB or 1000000000")
        return value.strip()

    @property
    def shard_bytes(self) -> int | str:
        """`max_shard_size` as save_pretrained takes it (a plain number is a byte count)."""
        return int(self.max_shard_size) if self.max_shard_size.isdigit() else self.max_shard_size
