"""The Tinker protocol's training submits, read from their bodies (api/tinker_codec) and made through the training
service: what the routes (api/routes/training.py) and the middleware that answers them before the framework
(api/submits.py) both do."""

from __future__ import annotations

from api.context import ApiContext
from api.schemas import OptimStepBody
from api.services import training
from api.tinker_codec import adam_params_from_json, decode_forward_backward
from twinkle.errors import InvalidRequest
from twinkle.futures import Op
from twinkle.records import ModelRecord
from twinkle.tenancy import TenantPolicy


async def forward_backward(ctx: ApiContext, tenant: str, policy: TenantPolicy, body: bytes, content_type: str,
                           content_encoding: str | None, *, forward_only: bool) -> tuple[ModelRecord, str]:
    """A forward_backward (or forward) request body as the Tinker SDK sends it: protobuf or JSON, maybe zstd."""
    meta, batch, _is_proto = decode_forward_backward(body, content_type, content_encoding,
                                                     max_bytes=ctx.max_request_bytes, vocab_size=None)
    return await training.forward_backward(ctx, tenant, policy, meta.model_id, batch, seq_id=meta.seq_id,
                                           forward_only=forward_only or meta.forward_only, provenance=meta.provenance)


async def optim_step(ctx: ApiContext, tenant: str, policy: TenantPolicy,
                     body: OptimStepBody) -> tuple[ModelRecord, str]:
    if body.adam_params is None:
        raise InvalidRequest("optim_step needs adam_params.", hint="Only the Adam optimizer is supported.")
    record = await ctx.store.model_to_submit(body.model_id, tenant)
    params = adam_params_from_json(body.adam_params.model_dump())
    return record, await training.submit_op(ctx, tenant, policy, record, Op.OPTIM_STEP, params, seq_id=body.seq_id,
                                            check_model=True)
