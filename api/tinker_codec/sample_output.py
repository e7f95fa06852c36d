"""A sampling result as the `tinker_public.SampleResponse` protobuf the SDK requires."""

from __future__ import annotations

from typing import Any

import numpy as np

from api.tinker_codec import wire_schema as pb
from twinkle.types import SampleOutput

# The SDK reads a (0, MASK_LOGPROB) cell as "no entry" (tinker.types.topk_logprobs).
TOPK_PAD_TOKEN = 0
TOPK_PAD_LOGPROB = -99999.0

_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def encode_sample_output(out: SampleOutput, num_prompt_tokens: int) -> bytes:
    """Serialize `out` for a prompt of `num_prompt_tokens` positions; a ValueError is a server bug."""
    msg = pb.SampleResponse()
    for index, sequence in enumerate(out.sequences):
        where = f"sequences[{index}]"
        stop_reason = _STOP_REASONS.get(sequence.stop_reason)
        if stop_reason is None:
            raise ValueError(f"{where}.stop_reason {sequence.stop_reason!r} is neither 'stop' nor 'length'.")
        wire = msg.sequences.add()
        wire.stop_reason = stop_reason
        wire.tokens = _int32_bytes(sequence.tokens, f"{where}.tokens")
        if sequence.logprobs:
            if len(sequence.logprobs) != len(sequence.tokens):
                raise ValueError(f"{where} has {len(sequence.logprobs)} logprobs for {len(sequence.tokens)} tokens.")
            wire.logprobs = np.asarray(sequence.logprobs, dtype="<f4").tobytes()
        if sequence.topk_logprobs is not None:
            if len(sequence.topk_logprobs) != len(sequence.tokens):
                raise ValueError(f"{where} has {len(sequence.topk_logprobs)} top-k rows for "
                                 f"{len(sequence.tokens)} tokens.")
            _fill_topk(wire.topk_sampled_logprobs, sequence.topk_logprobs, f"{where}.topk_logprobs")
    if out.prompt_logprobs is not None:
        _check_prompt_length(len(out.prompt_logprobs), num_prompt_tokens, "prompt_logprobs")
        values = [np.nan if value is None else value for value in out.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if out.topk_prompt_logprobs is not None:
        _check_prompt_length(len(out.topk_prompt_logprobs), num_prompt_tokens, "topk_prompt_logprobs")
        _fill_topk(msg.topk_prompt_logprobs, out.topk_prompt_logprobs, "topk_prompt_logprobs")
    return bytes(msg.SerializeToString())


def _fill_topk(wire: Any, rows: list[list[tuple[int, float]]], where: str) -> None:
    """`length x k` matrices, padded with (TOPK_PAD_TOKEN, TOPK_PAD_LOGPROB); the field is set even when empty."""
    k = max((len(row) for row in rows if row), default=0)
    token_ids = np.full((len(rows), k), TOPK_PAD_TOKEN, dtype=np.int64)
    logprobs = np.full((len(rows), k), TOPK_PAD_LOGPROB, dtype="<f4")
    for position, row in enumerate(rows):
        for rank, (token, logprob) in enumerate(row or ()):
            token_ids[position, rank] = token
            logprobs[position, rank] = logprob
    wire.k = k
    wire.length = len(rows)
    wire.token_ids = _int32_bytes(token_ids.reshape(-1), f"{where} token ids")
    wire.logprobs = logprobs.tobytes()


def _int32_bytes(values: Any, where: str) -> bytes:
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{where} holds a token id that does not fit the wire's int32.")
    return array.astype("<i4").tobytes()


def _check_prompt_length(length: int, num_prompt_tokens: int, field: str) -> None:
    if length != num_prompt_tokens:
        raise ValueError(f"{field} has {length} positions, but the prompt has {num_prompt_tokens}.")
