"""Weights that leave the training loop: save_weights_external and export_merged (futures) and copy_weights
(plain reply)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header

from api.deps import Ctx, Policy, Tenant
from api.responses.answer import described_by
from api.responses.tinker import CopiedCheckpoint, ExportFuture, FutureHandle
from api.schemas import CopyWeightsBody, ExportMergedBody, SaveWeightsExternalBody
from api.services import checkpoint_copies, checkpoints
from twinkle.checkpoints import validate_name
from twinkle.encryption import parse_recipients
from twinkle.errors import InvalidRequest
from twinkle.futures import Op
from twinkle.types import SaveRequest

router = APIRouter()


@router.post("/save_weights_external", response_model=described_by(FutureHandle))
async def save_weights_external(body: SaveWeightsExternalBody, ctx: Ctx, tenant: Tenant,
                                policy: Policy) -> dict[str, Any]:
    record = await ctx.store.model(body.model_id, tenant)
    recipients = tuple(body.age_encryption_recipients or ())
    parse_recipients(recipients)  # a bad key is a 400 now, not a failed future later
    req = SaveRequest(name=validate_name(body.path), kind="external_weights", include_optimizer=False,
                      ttl_seconds=body.ttl_seconds, age_recipients=recipients)
    rid = await checkpoints.save(ctx, tenant, policy, record, Op.SAVE_WEIGHTS_EXTERNAL, req, seq_id=body.seq_id)
    return {"request_id": rid, "model_id": record.model_id}


@router.post("/export_merged", response_model=described_by(ExportFuture))
async def export_merged(body: ExportMergedBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    """Merge a checkpoint's LoRA into the base weights on its model's pool, checked before it is offered
    (twinkle.merged_export); a future. One merge per checkpoint: a request while one runs gets its future, a
    later one the recorded result. Counted like a checkpoint save (quotas, rate, outstanding writes)."""
    winner, ref = await checkpoints.export_merged(ctx, tenant, policy, body.path)
    return {"request_id": winner, "path": ref.uri()}


@router.post("/copy_weights", response_model=described_by(CopiedCheckpoint))
async def copy_weights(
    body: CopyWeightsBody, ctx: Ctx, tenant: Tenant,
    x_idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    x_tinker_weights_access_token: Annotated[str | None, Header()] = None,
) -> dict[str, str]:
    """A new training run holding the checkpoint under the same kind and name; files are hard links.

    The SDK sends one idempotency key across all retries of a call, so a retried copy answers the
    first copy's path instead of making a second one.
    """
    if body.weights_access_token or x_tinker_weights_access_token:
        raise InvalidRequest("Copying weights from another account is not supported.",
                             hint="Copy checkpoints of your own API key (leave weights_access_token unset).")
    return {"tinker_path": await checkpoint_copies.copy_weights(
        ctx, tenant, body.source_path, idempotency_key=x_idempotency_key, session_id=body.session_id,
        model_seq_id=body.model_seq_id, destination_project_id=body.destination_project_id,
        ttl_seconds=body.ttl_seconds)}
