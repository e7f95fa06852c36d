"""Results as the JSON bodies of SDK 0.16 (and any client that does not ask for protobuf)."""

from __future__ import annotations

from typing import Any

import numpy as np

from twinkle.types import ForwardBackwardOutput, SampleOutput


def forward_output_json(out: ForwardBackwardOutput) -> dict[str, Any]:
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "loss_fn_outputs": [
            {name: {"data": np.asarray(a).ravel().tolist(), "dtype": _dtype(a), "shape": list(np.shape(a))}
             for name, a in outputs.items()}
            for outputs in out.loss_fn_outputs
        ],
        "metrics": out.metrics,
    }


def sample_output_json(out: SampleOutput) -> dict[str, Any]:
    return {
        "type": "sample",
        "sequences": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason,
                       **({"topk_logprobs": s.topk_logprobs} if s.topk_logprobs is not None else {})}
                      for s in out.sequences],
        "prompt_logprobs": out.prompt_logprobs,
        "topk_prompt_logprobs": out.topk_prompt_logprobs,
    }


def _dtype(a: Any) -> str:
    return "int64" if np.issubdtype(np.asarray(a).dtype, np.integer) else "float32"
