"""`POST /retrieve_future`: the long-poll every compute call ends in (docs/tinker_protocol.md#futures)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from api.context import ApiContext
from api.deps import Ctx, Tenant
from api.finite_json import FiniteJSONResponse
from api.long_poll import await_future, failed_answer, parked_poll
from api.responses.futures import FUTURE_RESPONSES
from api.schemas import RetrieveFutureBody
from api.services.futures import waiting_state
from api.tinker_codec import (
    encode_forward_backward_output,
    encode_sample_output,
    forward_output_json,
    sample_output_json,
)
from twinkle.futures import FutureRecord, FutureStatus, Op
from twinkle.telemetry import link_future
from twinkle.types import ForwardBackwardOutput, SampleOutput

router = APIRouter()
PROTOBUF = "application/x-protobuf"


@router.post("/retrieve_future", response_model=None, responses=FUTURE_RESPONSES)
async def retrieve_future(body: RetrieveFutureBody, request: Request, ctx: Ctx, tenant: Tenant
                          ) -> Response | dict[str, Any]:
    parked = parked_poll(request.scope, body.request_id, tenant)  # api.long_poll waited for it, shallower
    if parked is not None and parked.record is not None:
        record = parked.record
    else:
        timeout = parked.remaining() if parked is not None else ctx.long_poll_seconds
        record = await await_future(ctx, body.request_id, tenant, timeout)
    link_future(record)
    if record.state is FutureStatus.FAILED:
        return failed_answer(record)
    if not record.state.terminal:
        return await _try_again(ctx, record)
    result = await ctx.store.result(record.request_id)
    wants_proto = PROTOBUF in request.headers.get("accept", "")
    return _render_result(record, result, wants_proto)


async def _try_again(ctx: ApiContext, record: FutureRecord) -> dict[str, Any]:
    queue_state, reason = await waiting_state(ctx, record)
    return {"type": "try_again", "request_id": record.request_id, "queue_state": queue_state,
            "queue_state_reason": reason, "status": record.status}


def _render_result(record: FutureRecord, result: Any, wants_proto: bool) -> Response | dict[str, Any]:
    if isinstance(result, ForwardBackwardOutput):
        if wants_proto:
            return Response(encode_forward_backward_output(result), media_type=PROTOBUF)
        return FiniteJSONResponse(forward_output_json(result))
    if isinstance(result, SampleOutput):
        if wants_proto:
            return Response(encode_sample_output(result, result.prompt_length), media_type=PROTOBUF)
        return FiniteJSONResponse(sample_output_json(result))
    body = dict(result or {})
    body.setdefault("type", _TYPE_TAGS.get(record.op, record.op))
    return body


_TYPE_TAGS: dict[str, str] = {Op.SAVE_STATE: "save_weights", Op.LOAD_STATE: "load_weights"}
