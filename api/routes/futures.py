"""`POST /retrieve_future`: the long-poll every compute call ends in (docs/tinker_protocol.md#futures)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from api.context import ApiContext
from api.deps import Ctx, Tenant
from api.future_answer import accepts_protobuf, failed_answer, result_answer
from api.long_poll import await_future, parked_poll
from api.responses.futures import FUTURE_RESPONSES
from api.schemas import RetrieveFutureBody
from api.services.futures import waiting_state
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.telemetry import link_future

router = APIRouter()


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
    answer, media_type = result_answer(record, result, protobuf=accepts_protobuf(request.headers.get("accept", "")))
    return Response(answer, media_type=media_type)


async def _try_again(ctx: ApiContext, record: FutureRecord) -> dict[str, Any]:
    queue_state, reason = await waiting_state(ctx, record)
    return {"type": "try_again", "request_id": record.request_id, "queue_state": queue_state,
            "queue_state_reason": reason, "status": record.status}
