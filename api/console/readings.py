"""What the console shows, read from Redis: one tenant's resources, and for operators every pool.

Every read is scoped to the caller's tenant the way the API routes are (a foreign run id is NotFound), and
bounded: the latest MAX_ROWS of each list, the latest ops from the owner's capped request index.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from api.context import ApiContext
from api.ratelimit import request_window, token_window
from twinkle.broker import UNACKED
from twinkle.catalog import processor_queue
from twinkle.futures import FutureRecord, FutureStatus
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def tenant_readings(ctx: ApiContext, tenant: str) -> TenantReadings:
    r, keys = ctx.store.r, ctx.keys
    out = TenantReadings(tenant=tenant)
    session_ids = sorted(_text(s) for s in await r.smembers(keys.owner_sessions(tenant)))
    sampling_ids = sorted(_text(s) for s in await r.smembers(keys.owner_sampling_sessions(tenant)))
    request_ids = [_text(x) for x in await r.zrevrange(keys.owner_futures(tenant), 0, MAX_OPS - 1)]
    pipe = r.pipeline(transaction=False)
    for sid in session_ids:
        pipe.hgetall(keys.session(sid))
    for sid in sampling_ids:
        pipe.hgetall(keys.sampling_session(sid))
    for rid in request_ids:
        pipe.hgetall(keys.future(rid))
    replies = await pipe.execute()
    sessions = [SessionRecord.from_hash(h) for h in replies[: len(session_ids)] if h]
    out.sessions = sorted((s for s in sessions if s.owner == tenant), key=lambda s: -s.created_at)[:MAX_ROWS]
    sampling = [SamplingSessionRecord.from_hash(h) for h in replies[len(session_ids) : len(session_ids)
                                                                       + len(sampling_ids)] if h]
    out.sampling_sessions = sorted((s for s in sampling if s.owner == tenant),
                                   key=lambda s: -s.created_at)[:MAX_ROWS]
    out.runs = [run for run in await ctx.store.list_runs(tenant) if run.owner == tenant][:MAX_ROWS]
    for raw in replies[len(session_ids) + len(sampling_ids) :]:
        if not raw:
            continue  # expired
        record = FutureRecord.from_hash(raw)
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
        used = await ctx.store.r.zcount(ctx.keys.rate_window(tenant, app, "requests"),
                                        f"({now_ms - requests.ms}", "+inf")
        entries = await ctx.store.r.zrangebyscore(ctx.keys.rate_window(tenant, app, "tokens"),
                                                  f"({now_ms - tokens.ms}", "+inf")
        token_count = sum(int(_text(e).rpartition(":")[2] or 0) for e in entries)
        usages.append(RateUsage(app, int(used), requests.allowed, token_count, tokens.allowed,
                                config.window_seconds))
    return usages


async def run_series(ctx: ApiContext, tenant: str, run_id: str) -> tuple[ModelRecord, dict[str, Any]]:
    """The run (NotFound unless the caller owns it) and its metrics per step."""
    run = await ctx.store.model(run_id, tenant, active=False)
    raw = await ctx.store.r.lrange(ctx.keys.run_metrics(run_id), 0, -1)
    return run, step_series([parse_entry(e) for e in raw])


async def pool_readings(ctx: ApiContext) -> list[PoolReading]:
    r, keys = ctx.store.r, ctx.keys
    pools: list[PoolReading] = []
    for app in ctx.config.model_apps():
        served = ctx.catalog.by_app(app.name)
        for queue in served.model_queues if served else []:
            pools.append(PoolReading(queue, app.name, "model", False, 0,
                                     max_loras=int(app.args.adapter_config.max_loras)))
    for app in ctx.config.sampler_apps():
        served = ctx.catalog.by_app(app.name)
        if served and served.sampler_queue:
            pools.append(PoolReading(served.sampler_queue, app.name, "sampler", False, 0))
    for app in ctx.config.processor_apps():
        pools.append(PoolReading(processor_queue(app.name), app.name, "processor", False, 0))
    pipe = r.pipeline(transaction=False)
    for pool in pools:
        pipe.exists(keys.pool_heartbeat(pool.queue))
        pipe.scard(keys.pool_adapters(pool.queue))
        pipe.scard(keys.pool_assigned(pool.queue))
        pipe.llen(pool.queue)
    pipe.hvals(UNACKED)  # kombu's hash of delivered, unacked messages (not under Twinkle's prefix)
    *replies, unacked = await pipe.execute()
    for i, pool in enumerate(pools):
        beating, resident, assigned, waiting = replies[4 * i : 4 * i + 4]
        pool.ready, pool.depth = bool(beating), int(waiting)
        if pool.kind == "model":
            pool.resident, pool.assigned = int(resident), int(assigned)
    by_queue = {p.queue: p for p in pools}
    for raw in unacked:  # delivered but not acked: running, or prefetched by the worker
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        if routing_key in by_queue:
            by_queue[routing_key].depth += 1
    return pools


async def recent_errors(ctx: ApiContext, limit: int = 20) -> list[dict[str, Any]]:
    return [json.loads(e) for e in await ctx.store.r.lrange(ctx.keys.recent_errors(), 0, limit - 1)]
