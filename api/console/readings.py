"""What the console shows, read through the store: one tenant's resources, and for operators every pool.

Every read is scoped to the caller's tenant the way the API routes are (a foreign run id is NotFound), and
bounded: the latest MAX_ROWS of each list, the latest ops from the owner's capped request index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from api.context import ApiContext
from api.ratelimit import request_window, token_window
from twinkle.catalog import processor_queue
from twinkle.futures import FutureRecord, FutureStatus
from twinkle.ledger import messages
from twinkle.records import ModelRecord, SamplingSessionRecord, SessionRecord
from twinkle.run_metrics import parse_entry, step_series

MAX_ROWS = 50
MAX_OPS = 20  # the latest requests listed, pending or not


@dataclass
class PendingOp:
    record: FutureRecord
    position: int | None  # ops ahead in its queue; None once running


@dataclass
class RateUsage:
    pool: str
    requests: int
    requests_allowed: float
    tokens: int
    tokens_allowed: float
    window_seconds: float


@dataclass
class TenantReadings:
    tenant: str
    sessions: list[SessionRecord] = field(default_factory=list)
    runs: list[ModelRecord] = field(default_factory=list)
    sampling_sessions: list[SamplingSessionRecord] = field(default_factory=list)
    ops: list[PendingOp] = field(default_factory=list)  # newest first; queued and running ones with positions
    rates: list[RateUsage] = field(default_factory=list)


@dataclass
class PoolReading:
    queue: str
    app: str
    kind: str  # model | sampler | processor
    ready: bool
    depth: int
    resident: int | None = None  # adapters in device memory (model pools)
    assigned: int | None = None  # active adapters pinned to the pool, resident or paged out
    max_loras: int | None = None


async def tenant_readings(ctx: ApiContext, tenant: str) -> TenantReadings:
    out = TenantReadings(tenant=tenant)
    sessions, sampling, futures = await ctx.store.owner_records(tenant, MAX_OPS)
    out.sessions = sorted((s for s in sessions if s.owner == tenant), key=lambda s: -s.created_at)[:MAX_ROWS]
    out.sampling_sessions = sorted((s for s in sampling if s.owner == tenant),
                                   key=lambda s: -s.created_at)[:MAX_ROWS]
    out.runs = [run for run in await ctx.store.list_runs(tenant) if run.owner == tenant][:MAX_ROWS]
    for record in futures:
        if record.owner != tenant:
            continue
        position = await ctx.store.queue_position(record) if record.state is FutureStatus.QUEUED else None
        out.ops.append(PendingOp(record, position))
    out.rates = await rate_usage(ctx, tenant)
    return out


async def rate_usage(ctx: ApiContext, tenant: str) -> list[RateUsage]:
    """The caller's use of each pool's rate limits in the current window (pools with limits only)."""
    usages = []
    now_ms = time.time() * 1000
    for app, config in ctx.limiter.limits.items():
        if config is None or not config.enabled:
            continue
        requests, tokens = request_window(config), token_window(config)
        if not requests.allowed and not tokens.allowed:
            continue
        used, token_count = await ctx.limiter.window_use(tenant, app, requests, tokens, now_ms)
        usages.append(RateUsage(app, used, requests.allowed, token_count, tokens.allowed, config.window_seconds))
    return usages


async def run_series(ctx: ApiContext, tenant: str, run_id: str) -> tuple[ModelRecord, dict[str, Any]]:
    """The run (NotFound unless the caller owns it) and its metrics per step."""
    run = await ctx.store.model(run_id, tenant, active=False)
    return run, step_series([parse_entry(e) for e in await ctx.store.run_metrics(run_id)])


async def pool_readings(ctx: ApiContext) -> list[PoolReading]:
    pools: list[PoolReading] = []
    for app in ctx.config.model_apps():
        served = ctx.catalog.by_app(app.name)
        for queue in served.model_queues if served else []:
            pools.append(PoolReading(queue, app.name, "model", False, 0,
                                     max_loras=int(app.args.adapter_config.max_loras)))
    for sampler in ctx.config.sampler_apps():
        served = ctx.catalog.by_app(sampler.name)
        if served and served.sampler_queue:
            pools.append(PoolReading(served.sampler_queue, sampler.name, "sampler", False, 0))
    for processor in ctx.config.processor_apps():
        pools.append(PoolReading(processor_queue(processor.name), processor.name, "processor", False, 0))
    delivered = messages.deliveries_by_queue()  # running, or prefetched by the worker
    states, held = await ctx.pools.readings([pool.queue for pool in pools], delivered)
    for pool, (beating, resident, assigned, waiting) in zip(pools, states, strict=True):
        pool.ready, pool.depth = beating, waiting
        if pool.kind == "model":
            pool.resident, pool.assigned = resident, assigned
    by_queue = {p.queue: p for p in pools}
    for queue, count in delivered.decode([held]).items():
        if queue in by_queue:
            by_queue[queue].depth += count
    return pools


async def recent_errors(ctx: ApiContext, limit: int = 20) -> list[dict[str, Any]]:
    return await ctx.store.recent_errors(limit)
