"""Datums to right-padded tensors, and target-token logprobs from logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from twinkle.errors import InvalidRequest
from twinkle.types import Datum


@dataclass
class PaddedBatch:
    """A batch right-padded to its longest datum; `mask` marks real positions."""

    input_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # int64 [B, T]
    targets: torch.Tensor  # int64 [B, T] or [B, T, K]
    inputs: dict[str, torch.Tensor]  # float32, each shaped like targets
    lengths: list[int]
    vision: dict[str, torch.Tensor] = field(default_factory=dict)  # extra forward arguments (pixel_values, ...)

    @property
    def mask(self) -> torch.Tensor:
        return self.attention_mask.bool()

    def unpad(self, values: torch.Tensor) -> list[np.ndarray]:
        """Per-datum float32 arrays of a [B, T, ...] tensor, padding cut off."""
        host = values.detach().float().cpu().numpy()
        return [host[row, :length].copy() for row, length in enumerate(self.lengths)]


def check_model_inputs(data: Sequence[Datum], *, vocab_size: int, max_length: int) -> None:
    """Reject what the model cannot run: images, empty inputs, overlong inputs, out-of-vocabulary tokens."""
    problems = []
    for index, datum in enumerate(data):
        if datum.images():
            problems.append(f"datum {index} holds images but this model reads text only")
            continue
        tokens = datum.tokens()
        if len(tokens) == 0:
            problems.append(f"datum {index} has no tokens")
        elif len(tokens) > max_length:
            problems.append(f"datum {index} has {len(tokens)} tokens, over the max_length of {max_length}")
        targets = np.asarray(datum.loss_fn_inputs.get("target_tokens", np.zeros(0, np.int64)))
        for name, ids in (("model_input", tokens), ("target_tokens", targets)):
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                problems.append(f"datum {index} {name} has token ids outside [0, {vocab_size})")
    if problems:
        raise InvalidRequest(
            "The batch cannot run on this model: " + "; ".join(problems[:10]) + ".",
            hint=f"Truncate datums to at most {max_length} tokens and use this model's tokenizer.",
            problems=len(problems),
        )


def collate(
    data: Sequence[Datum], inputs: Sequence[dict[str, np.ndarray]], *, pad_token_id: int, device: torch.device
) -> PaddedBatch:
    """Right-pad tokens, targets and per-token loss inputs (padding 0) into one batch on `device`."""
    lengths = [len(datum.tokens()) for datum in data]
    target_shapes = {np.asarray(row["target_tokens"]).shape[1:] for row in inputs}
    if len(target_shapes) > 1:
        raise InvalidRequest(
            "All datums of a batch must have target_tokens of one shape, [T] or [T, K] with the same K.",
            hint=f"Got trailing shapes {sorted(target_shapes)}.",
        )
    trailing = target_shapes.pop()
    size, width = len(data), max(lengths)
    input_ids = np.full((size, width), pad_token_id, np.int64)
    attention = np.zeros((size, width), np.int64)
    targets = np.zeros((size, width, *trailing), np.int64)
    names = [key for key in inputs[0] if key != "target_tokens"]
    padded = {key: np.zeros((size, width, *trailing), np.float32) for key in names}
    for row, (datum, arrays) in enumerate(zip(data, inputs, strict=True)):
        length = lengths[row]
        input_ids[row, :length] = datum.tokens()
        attention[row, :length] = 1
        targets[row, :length] = arrays["target_tokens"]
        for key in names:
            padded[key][row, :length] = arrays[key]
    return PaddedBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        attention_mask=torch.from_numpy(attention).to(device),
        targets=torch.from_numpy(targets).to(device),
        inputs={key: torch.from_numpy(value).to(device) for key, value in padded.items()},
        lengths=lengths,
    )


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax of `logits` [B, T, V] at `targets` ([B, T] or [B, T, K]).

    Trainer and sampler both go through here, so their logprobs for the same tokens agree.
    """
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    index = targets.unsqueeze(-1) if targets.dim() == logits.dim() - 1 else targets
    picked = logits.gather(-1, index) - normalizer
    return picked.squeeze(-1) if targets.dim() == logits.dim() - 1 else picked


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely token ids of each row of `logits` [..., V] and their float32 logprobs, best first
    (the same arithmetic as `target_logprobs`, so a top-k entry equals the target logprob of that token)."""
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return top.indices, top.values - normalizer
