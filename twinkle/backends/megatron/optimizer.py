"""One tenant's optimizer step across data- and tensor-parallel ranks.

A tenant's LoRA weights are a fraction of a percent of the model, and the frozen base has no optimizer
state at all, so each rank keeps plain AdamW state for its own shards (the same optimizer as the
transformers backend); Megatron's DistributedOptimizer, which shards state over data-parallel ranks, would
save little here. What parallelism changes is the gradient: data-parallel ranks saw different datums, so
their gradients are summed (the loss is a sum over the batch); and the norm used for clipping counts each
tensor-parallel shard once and each replicated tensor once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twinkle.backends.hf.tenant import Tenant, check_adam_params
from twinkle.types import AdamParams


def sum_data_parallel_gradients(params: Sequence[nn.Parameter], dp_group: Any) -> None:
    """Make every data-parallel rank hold the gradient of the whole batch."""
    if not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=dp_group)


def global_grad_norm(params: Sequence[nn.Parameter], sharded: Sequence[bool], tp_group: Any) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient, the same on every tensor-parallel rank."""
    device = params[0].device if params else torch.device("cpu")
    shard_squares = torch.zeros((), dtype=torch.float32, device=device)
    replicated_squares = torch.zeros((), dtype=torch.float32, device=device)
    for param, is_sharded in zip(params, sharded, strict=True):
        if param.grad is None:
            continue
        square = param.grad.detach().float().pow(2).sum()
        if is_sharded:
            shard_squares += square
        else:
            replicated_squares += square
    if dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(shard_squares, op=dist.ReduceOp.SUM, group=tp_group)
    return (shard_squares + replicated_squares).sqrt()


def adam_step(
    tenant: Tenant, params: AdamParams, *, sharded: Sequence[bool], dp_group: Any, tp_group: Any
) -> dict[str, float]:
    """Reduce, clip, step and zero the tenant's gradients; the grad norm is measured before clipping."""
    check_adam_params(params)
    sum_data_parallel_gradients(tenant.params, dp_group)
    norm = global_grad_norm(tenant.params, sharded, tp_group)
    if params.grad_clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(tenant.params, params.grad_clip_norm, norm)
    for group in tenant.optimizer.param_groups:
        group["lr"] = params.learning_rate
        group["betas"] = (params.beta1, params.beta2)
        group["eps"] = params.eps
        group["weight_decay"] = params.weight_decay
    tenant.optimizer.step()
    tenant.zero_grad()
    tenant.steps += 1
    return {"grad_norm:mean": float(norm), "learning_rate:mean": float(params.learning_rate)}
