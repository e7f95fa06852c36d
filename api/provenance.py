"""Provenance for `stable_reinforce`: which sampled sequences a tenant recorded, and the checks a batch passes.

The Tinker docs' contract: sample with `record_stability_info=True`; every returned sequence carries a
`sequence_id`; a stable_reinforce datum names, with provenance spans (`Datum.with_provenance`), the
sequence behind each target position; recorded sequences belong to whoever sampled them and can be
trained on for one day after sampling, each training request that uses one restarting that day; and the
loss trains sampled tokens only, so positions that came from a prompt carry a zero advantage.

Twinkle records per sample request the owner, the prompt length and the number of sequences
(`sequence_id` is `<request_id>:<index>`), under a key that expires after a day (api/stability_records.py).
The loss itself reads the datum's own sampling `logprobs` (see twinkle.losses); these checks make a batch that
Tinker would refuse fail here too, with every problem listed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from twinkle.errors import InvalidRequest
from twinkle.types import Datum

if TYPE_CHECKING:
    from api.stability_records import StabilityRecords

_MAX_LISTED_PROBLEMS = 10


@dataclass(frozen=True)
class Span:
    """One run of a provenance tiling: `length` positions from `[offset, offset + length)` of a sequence's
    prompt (`prompt`) or of its sampled tokens (`sampled`)."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


def spans_from_proto(messages: Any, where: str) -> tuple[Span, ...] | None:
    """The spans of a repeated `tinker_public.ProvenanceSpan` field; None when the field is empty."""
    spans = []
    for index, message in enumerate(messages):
        kind = message.WhichOneof("span")
        if kind is None:
            raise InvalidRequest(f"{where}[{index}] is neither a prompt nor a sampled provenance span.")
        run = message.prompt_tokens if kind == "prompt_tokens" else message.sampled_tokens
        if run.offset < 0 or run.length < 0 or not run.sequence_id or len(run.sequence_id) > 200:
            raise InvalidRequest(f"{where}[{index}] needs a sequence_id (at most 200 characters), offset >= 0 "
                                 "and length >= 0.")
        spans.append(Span("prompt" if kind == "prompt_tokens" else "sampled", run.sequence_id, run.offset, run.length))
    return tuple(spans) or None


async def check_provenance(records: StabilityRecords, owner: str, data: Sequence[Datum],
                           spans: Sequence[tuple[Span, ...] | None]) -> None:
    """Raise one InvalidRequest listing every provenance problem of a stable_reinforce batch; on success
    restart the day of every recorded sample the batch uses."""
    request_ids = sorted({_request_id(s.sequence_id) for datum_spans in spans for s in datum_spans or ()})
    found = await records.read(request_ids) if request_ids else {}
    problems: list[str] = []
    for index, (datum, datum_spans) in enumerate(zip(data, spans, strict=True)):
        problems.extend(f"data[{index}]: {p}" for p in _datum_problems(datum, datum_spans, found, owner))
    if problems:
        listed = problems[:_MAX_LISTED_PROBLEMS]
        more = f"; and {len(problems) - len(listed)} more" if len(problems) > len(listed) else ""
        raise InvalidRequest(
            "Invalid stable_reinforce request: " + "; ".join(listed) + more + ".",
            hint="Sample with record_stability_info=True (save_weights_and_get_sampling_client(record_stability_"
                 "info=True)), annotate each datum with Datum.with_provenance naming each SampledSequence."
                 "sequence_id, and train within a day; or use another loss_fn.",
            problems=len(problems))
    await records.renew(request_ids)


def _request_id(sequence_id: str) -> str:
    return sequence_id.rpartition(":")[0] or sequence_id


def _datum_problems(datum: Datum, spans: tuple[Span, ...] | None, records: dict[str, dict[bytes, bytes]],
                    owner: str) -> list[str]:
    if spans is None:
        return ["has no provenance: stable_reinforce needs loss_fn_input_spans (Datum.with_provenance) naming "
                "the sampled sequence behind each target position"]
    positions = int(np.asarray(datum.loss_fn_inputs["target_tokens"]).shape[0])
    covered = sum(s.length for s in spans)
    if covered != positions:
        return [f"its provenance spans cover {covered} positions but target_tokens has {positions}; they must "
                "tile target_tokens exactly"]
    problems = []
    advantages = np.asarray(datum.loss_fn_inputs["advantages"])
    start = 0
    for span in spans:
        problems.extend(_span_problems(span, records.get(_request_id(span.sequence_id)) or {}, owner))
        end = start + span.length
        if span.kind == "prompt" and np.any(advantages[start:end] != 0):
            problems.append(f"positions {start}..{end - 1} come from a prompt but have nonzero advantages; "
                            "stable_reinforce trains sampled tokens only")
        start = end
    return problems


def _span_problems(span: Span, record: dict[bytes, bytes], owner: str) -> list[str]:
    if not record or record.get(b"owner", b"").decode() != owner:
        return [f"sequence_id {span.sequence_id!r} was not sampled with record_stability_info=True by this API "
                "key, or its day has passed"]
    index = span.sequence_id.rpartition(":")[2]
    if not index.isdigit() or int(index) >= int(record[b"samples"]):
        return [f"sequence_id {span.sequence_id!r} names no sequence of its sample request"]
    if span.kind == "prompt" and span.offset + span.length > int(record[b"prompt_tokens"]):
        return [f"a prompt span of {span.sequence_id!r} reaches position {span.offset + span.length} but that "
                f"prompt has {int(record[b'prompt_tokens'])} tokens"]
    return []
