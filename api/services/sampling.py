"""Where a sample op goes, for Tinker sampling sessions and OpenAI `model` names alike."""

from __future__ import annotations

from api.context import ApiContext
from twinkle.checkpoints import parse_checkpoint_path
from twinkle.errors import InvalidRequest


async def sampling_target(ctx: ApiContext, tenant: str, base_model: str | None, model_path: str | None
                  ) -> tuple[str, str, str | None]:
    """(served model name, queue, adapter directory) for sampling a base model or a checkpoint."""
    adapter_dir = None
    if model_path:
        ref = parse_checkpoint_path(model_path)
        adapter_dir = str(ctx.checkpoints.existing(tenant, ref))
        base_model = base_model or ctx.checkpoints.metadata(tenant, ref).get("base_model")
    if not base_model:
        raise InvalidRequest("Sampling needs base_model or model_path.",
                             hint="Pass the base model name, or a tinker:// sampler checkpoint path.")
    served = ctx.catalog.find(base_model)
    queue = served.sample_queue()
    if queue is None:
        raise InvalidRequest(f"No pool samples {served.name}.", hint="Configure a sampler or model application.")
    return served.name, queue, adapter_dir
