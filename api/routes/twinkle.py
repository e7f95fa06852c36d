"""Twinkle-native routes (`twinkle_client`): the model's training loop configured and run server-side.

Each compute call returns a future like the Tinker routes; results come back as JSON through
`/retrieve_future`. The routes only validate and enqueue; `workers/twinkle_ops.py` does the work.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field, field_validator

from api.context import ApiContext
from api.deps import Ctx, Policy, Tenant
from api.responses.answer import described_by
from api.responses.tinker import FutureHandle
from api.responses.twinkle import CapacityInfo
from api.schemas import Body
from api.services import checkpoints, training
from twinkle.catalog import processor_queue
from twinkle.checkpoints import parse_checkpoint_path, validate_name
from twinkle.errors import InvalidRequest
from twinkle.futures import Op
from twinkle.tenancy import TenantPolicy
from twinkle.types import LoadRequest, SaveRequest

router = APIRouter(prefix="/twinkle", tags=["twinkle"])
MAX_INPUTS = 4096
MAX_TOKEN_ID = 2**31 - 1
IGNORE_LABEL = -100


class ModelBody(Body):
    model_id: str = Field(max_length=300)


class ConfigureBody(ModelBody):
    gradient_accumulation_steps: int | None = Field(default=None, ge=1, le=4096)
    loss: str | None = None
    loss_kwargs: dict[str, float | str] | None = None
    optimizer: str | None = None
    optimizer_kwargs: dict[str, Any] | None = None
    lr_scheduler: str | None = None
    lr_scheduler_kwargs: dict[str, Any] | None = None
    template: str | None = None
    template_kwargs: dict[str, Any] | None = None
    processor: str | None = None
    processor_kwargs: dict[str, Any] | None = None
    max_grad_norm: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class InputsBody(ModelBody):
    model_config = ConfigDict(extra="ignore")
    inputs: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_INPUTS)
    loss_kwargs: dict[str, float | str] | None = None
    disable_lora: bool = False

    @field_validator("inputs")
    @classmethod
    def _inputs_are_features_or_trajectories(cls, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, item in enumerate(inputs):
            if "messages" in item:
                continue
            ids, labels = item.get("input_ids"), item.get("labels")
            if not isinstance(ids, list) or not all(_token_id(t) for t in ids):
                raise ValueError(f"inputs[{i}].input_ids must be a list of non-negative token ids")
            if not isinstance(labels, list) or len(labels) != len(ids):
                raise ValueError(f"inputs[{i}].labels must be a list as long as input_ids (-100 = not trained)")
            if not all(t == IGNORE_LABEL or _token_id(t) for t in labels):
                raise ValueError(f"inputs[{i}].labels must hold token ids, or -100 for tokens not trained")
        return inputs


def _token_id(value: Any) -> bool:
    # bool is an int in Python, but `true` is no token; ids past int32 are no vocabulary's
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


class StepBody(ModelBody):
    max_grad_norm: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class MetricBody(ModelBody):
    is_training: bool = True


class SaveBody(ModelBody):
    name: str = Field(max_length=200)
    save_optimizer: bool = True
    consumed_train_samples: int | None = Field(default=None, ge=0)
    kind: str = Field(default="weights", pattern="^(weights|sampler_weights)$")


class ResumeBody(ModelBody):
    path: str = Field(max_length=1000)
    resume_only_model: bool = False


class UploadBody(ModelBody):
    checkpoint_dir: str = Field(max_length=1000)
    hub_model_id: str = Field(max_length=300)
    hub_token: str | None = None
    private: bool = True


class EncodeBody(Body):
    template: str = Field(max_length=100)
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    rows: list[dict[str, Any]] = Field(min_length=1, max_length=10_000)
    add_generation_prompt: bool = False


async def _submit(ctx: ApiContext, tenant: str, policy: TenantPolicy, model_id: str, op: Op, payload: Any, *,
                  input_tokens: int = 0) -> dict[str, Any]:
    """Every op here is checked against the key's quotas and counts against its rate limits on its pool, as
    the Tinker routes do."""
    record, rid = await training.submit_to_model(ctx, tenant, policy, model_id, op, payload,
                                                 input_tokens=input_tokens)
    return {"request_id": rid, "model_id": record.model_id}


async def _check_vocabulary(ctx: ApiContext, tenant: str, body: InputsBody) -> None:
    """Token ids outside the model's vocabulary are refused here, on every backend, as the Tinker routes do."""
    _, _, info = await training.loaded_model(ctx, tenant, body.model_id)
    vocab = info.get("vocab_size")
    if not vocab:
        return
    for i, item in enumerate(body.inputs):
        for field in ("input_ids", "labels"):
            ids = item.get(field) if "messages" not in item else None
            top = max(ids, default=-1) if ids else -1
            if top >= vocab:
                raise InvalidRequest(f"inputs[{i}].{field} has token id {top}, outside the vocabulary (size {vocab}).",
                                     hint="Tokenize with the model's tokenizer.")


def _input_tokens(inputs: list[dict[str, Any]]) -> int:
    """Tokens of already-encoded inputs; trajectories (`messages`) are encoded in the pool and not counted."""
    return sum(len(item.get("input_ids") or ()) for item in inputs if "messages" not in item)


@router.post("/configure", response_model=described_by(FutureHandle))
async def configure(body: ConfigureBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    changes = body.model_dump(exclude={"model_id"}, exclude_none=True)
    return await _submit(ctx, tenant, policy, body.model_id, Op.CONFIGURE, changes)


@router.post("/forward_backward", response_model=described_by(FutureHandle))
async def forward_backward(body: InputsBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    await _check_vocabulary(ctx, tenant, body)
    payload = {"inputs": body.inputs, "loss_kwargs": body.loss_kwargs or {}}
    return await _submit(ctx, tenant, policy, body.model_id, Op.FORWARD_BACKWARD, payload,
                         input_tokens=_input_tokens(body.inputs))


@router.post("/forward_only", response_model=described_by(FutureHandle))
async def forward_only(body: InputsBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    await _check_vocabulary(ctx, tenant, body)
    payload = {"inputs": body.inputs, "loss_kwargs": body.loss_kwargs or {}, "disable_lora": body.disable_lora}
    return await _submit(ctx, tenant, policy, body.model_id, Op.FORWARD, payload,
                         input_tokens=_input_tokens(body.inputs))


@router.post("/clip_grad_and_step", response_model=described_by(FutureHandle))
async def clip_grad_and_step(body: StepBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await _submit(ctx, tenant, policy, body.model_id, Op.CLIP_GRAD_AND_STEP,
                         {"max_grad_norm": body.max_grad_norm})


@router.post("/calculate_metric", response_model=described_by(FutureHandle))
async def calculate_metric(body: MetricBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await _submit(ctx, tenant, policy, body.model_id, Op.CALCULATE_METRIC, {"is_training": body.is_training})


@router.post("/get_train_configs", response_model=described_by(FutureHandle))
async def get_train_configs(body: ModelBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    return await _submit(ctx, tenant, policy, body.model_id, Op.GET_TRAIN_CONFIGS, None)


@router.post("/save", response_model=described_by(FutureHandle))
async def save(body: SaveBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    req = SaveRequest(name=validate_name(body.name), kind=body.kind,  # type: ignore[arg-type]
                      include_optimizer=body.save_optimizer, overwrite=True,
                      consumed_train_samples=body.consumed_train_samples)
    op = Op.SAVE_STATE if body.kind == "weights" else Op.SAVE_WEIGHTS_FOR_SAMPLER
    record = await ctx.store.model(body.model_id, tenant)
    return {"request_id": await checkpoints.save(ctx, tenant, policy, record, op, req), "model_id": record.model_id}


@router.post("/resume_from_checkpoint", response_model=described_by(FutureHandle))
async def resume_from_checkpoint(body: ResumeBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    ref = parse_checkpoint_path(body.path)
    ctx.checkpoints.existing(tenant, ref)
    if ref.kind != "weights":
        raise InvalidRequest("Resume needs a training checkpoint (…/weights/<name>), not a sampler snapshot.")
    req = LoadRequest(owner=tenant, path=body.path, include_optimizer=not body.resume_only_model,
                      restore_trainer=True, only_model=body.resume_only_model)
    return await _submit(ctx, tenant, policy, body.model_id, Op.LOAD_STATE, req)


@router.post("/upload_to_hub", response_model=described_by(FutureHandle))
async def upload_to_hub(body: UploadBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    ctx.checkpoints.existing(tenant, parse_checkpoint_path(body.checkpoint_dir))
    payload = {"checkpoint_path": body.checkpoint_dir, "hub_model_id": body.hub_model_id,
               "hub_token": body.hub_token, "private": body.private}
    return await _submit(ctx, tenant, policy, body.model_id, Op.UPLOAD_TO_HUB, payload)


@router.get("/capacity_info", response_model=described_by(CapacityInfo))
async def capacity_info(ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    models = []
    for app in ctx.config.model_apps():
        served = ctx.catalog.by_app(app.name)
        used = 0
        for queue in served.model_queues if served else []:
            used += await ctx.pools.resident_adapters(queue)
        max_loras = app.args.adapter_config.max_loras * (len(served.model_queues) if served else 1)
        models.append({"model_name": served.name if served else app.name, "max_loras": max_loras,
                       "used_loras": used, "free_loras": max(0, max_loras - used)})
    return {"models": models}


@router.post("/encode", response_model=described_by(FutureHandle))
async def encode(body: EncodeBody, ctx: Ctx, tenant: Tenant, policy: Policy) -> dict[str, Any]:
    apps = ctx.config.processor_apps()
    if not apps:
        raise InvalidRequest("This server has no processor application.",
                             hint="Encode locally with twinkle.dataset.Dataset, or ask the operator to add one.")
    payload = body.model_dump()
    # Templates load only the tokenizers of served models, never an arbitrary hub id from a client.
    requested = str(body.template_kwargs.get("model_id") or next(iter(ctx.catalog.models), ""))
    payload["template_kwargs"] = {**body.template_kwargs, "model_id": ctx.catalog.find(requested).model_id}
    queue = processor_queue(apps[0].name)
    await ctx.quotas.check(tenant, policy, Op.ENCODE)
    await ctx.limiter.admit(tenant, queue)  # rows are not tokens yet: counted as one request
    rid = await ctx.store.submit(op=Op.ENCODE, owner=tenant, model_id="", queue=queue, payload=payload,
                                 weight=policy.weight)
    return {"request_id": rid}
