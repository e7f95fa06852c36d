"""`POST /import_adapter`: a tenant uploads a PEFT LoRA adapter and gets checkpoints of its own.

The body is a tar archive (plain or gzip-compressed) of `adapter_config.json` and `adapter_model.safetensors`,
streamed to disk as it arrives (limited to `storage.max_adapter_upload_bytes` by `api.body_limit`); the query
names the base model (else the config's `base_model_name_or_path` is matched against the served models), the
checkpoint name and a TTL. `twinkle.adapter_import` checks everything in it against the shapes the base model's
pool published. The adapter becomes a new training run of the caller (`import-<hex>`, status unloaded, like a
copy) holding `weights/<name>` and `sampler_weights/<name>` (hard links to the same two files), both in the
checkpoint index. `create_training_client_from_state(path)` trains on it (the run's metadata carries the LoRA
config that rebuilds it; no optimizer state), and the sampler path samples it, `/v1` included. The import
itself is api/services/adapter_imports.py's.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from api.deps import Ctx, Policy, Tenant
from api.responses.answer import described_by
from api.responses.tinker import ImportedAdapter
from api.services import adapter_imports
from twinkle.checkpoints import new_checkpoint_name, validate_name
from twinkle.errors import InvalidRequest
from twinkle.types import LoraSpec

router = APIRouter()

# Any content type is read as the archive; octet-stream is what generic OpenAPI tools know how to send.
_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {
    "type": "string", "format": "binary",
    "description": "A tar archive (plain or gzip-compressed) of a PEFT adapter directory: adapter_config.json and "
                   "adapter_model.safetensors, at its root or in one top directory (application/x-tar)."}}}}}


@router.post("/import_adapter", response_model=described_by(ImportedAdapter), openapi_extra=_BODY)
async def import_adapter(
    request: Request, ctx: Ctx, tenant: Tenant, policy: Policy,
    base_model: Annotated[str | None, Query(max_length=500)] = None,
    name: Annotated[str | None, Query(max_length=200)] = None,
    ttl_seconds: Annotated[int | None, Query(ge=1, le=10 * 365 * 86400)] = None,
) -> dict[str, Any]:
    checkpoint_name = validate_name(name) if name else new_checkpoint_name("import")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidRequest(f"Content-Encoding {encoding!r} is not accepted on an adapter upload.",
                             hint="Send the .tar or .tar.gz file itself as the body, without Content-Encoding.")
    imported = await adapter_imports.import_adapter(ctx, tenant, policy, request.stream(),
                                                    checkpoint_name=checkpoint_name, base_model=base_model,
                                                    ttl_seconds=ttl_seconds)
    return {
        "training_run_id": imported.weights.run_id,
        "path": imported.weights.uri(),
        "sampler_path": imported.sampler.uri(),
        "base_model": imported.served.name,
        "lora_rank": imported.spec.rank,
        "lora_config": lora_config(imported.spec),
        "size_bytes": imported.metadata.get("size_bytes"),
        "ignored_files": imported.upload.ignored,
    }


def lora_config(spec: LoraSpec) -> dict[str, Any]:
    """The adapter's LoRA settings under create_model's names (the Twinkle client's add_adapter_to_model)."""
    targets = spec.target_modules
    return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
            "target_modules": [targets] if isinstance(targets, str) else list(targets or ())}

