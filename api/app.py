"""The FastAPI application: one per API process, stateless apart from its Redis connections."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from api import errors
from api.access_log import AccessLog
from api.body_limit import BodyLimit
from api.checkpoint_writes import CheckpointWrites
from api.console import routes as console_routes
from api.context import ApiContext
from api.finite_json import FiniteJSONResponse
from api.hub import FutureHub
from api.key_share import KeyShare
from api.long_poll import LongPolls
from api.openai import routes as openai_routes
from api.pool_state import PoolState
from api.quotas import QuotaGate
from api.ratelimit import RateLimiter
from api.redis_client import blocking_client, redis_client
from api.responses.errors import ERROR_RESPONSES, OPENAI_ERROR_RESPONSES
from api.routes import (
    downloads,
    exports,
    futures,
    imports,
    rest,
    sampling,
    session,
    tokenizer,
    training,
    twinkle,
    usage,
)
from api.sdk_flags import sdk_flags
from api.stability_records import StabilityRecords
from api.store import Store
from api.submits import Submits
from api.usage_history import UsageHistory
from twinkle import launched_process
from twinkle.auth import KeyChecker
from twinkle.catalog import Catalog
from twinkle.celery_app import make_celery
from twinkle.checkpoints import CheckpointStore
from twinkle.export_store import ExportStore
from twinkle.keys import Keys
from twinkle.queue_timeouts import QueueTimeoutSweep, timeouts_by_queue
from twinkle.telemetry import setup_api_telemetry

if TYPE_CHECKING:
    from twinkle.config.server_config import ServerConfig

log = logging.getLogger("twinkle.api")
DEFAULT_PREFIX = "/api/v1"


def api_prefix(config: ServerConfig) -> str:
    server = config.server_app()
    return (server.route_prefix if server else DEFAULT_PREFIX).rstrip("/") or DEFAULT_PREFIX


def build_context(config: ServerConfig, broker_url: str, *, long_poll_seconds: float = 30.0) -> ApiContext:
    r = redis_client(broker_url)
    keys = Keys(config.persistence.key_prefix)
    server = config.server_app()
    session_ttl = int(server.args.server_config.expiration_timeout) if server else 86400
    celery = make_celery(broker_url, events=config.flower.enabled)
    catalog = Catalog(config)
    store = Store(r, keys, celery, future_ttl=config.storage.future_ttl_seconds, session_ttl=session_ttl,
                  backlog_windows=catalog.backlog_windows, reserving_queues=catalog.reserving_queues,
                  direct_send=not (config.flower.enabled or config.telemetry.enabled))  # both hook Celery's publish
    store.lost.queue_timeouts = timeouts_by_queue(config, catalog)  # a queued record read past it fails
    auth = KeyChecker(set(config.auth.api_keys), config.auth.keys_file, admin_hashes=set(config.auth.admin_keys),
                      tenancy=config.tenancy)
    hub = FutureHub(r, keys)
    store.submitted = hub.submitted.add  # a poll of a future submitted here may wait without reading it first
    return ApiContext(config=config, store=store, hub=hub, catalog=catalog, keys=keys, auth=auth,
                      checkpoints=CheckpointStore(config.storage.checkpoint_dir),
                      limiter=RateLimiter.from_config(r, keys, config, catalog), quotas=QuotaGate(r, keys),
                      pools=PoolState(r, keys), stability=StabilityRecords(r, keys),
                      usage_history=UsageHistory(r, keys),
                      writes=CheckpointWrites(r, keys, per_key=config.storage.checkpoint_writes_per_key,
                                              future_ttl=config.storage.future_ttl_seconds),
                      export_store=ExportStore.from_storage(config.storage),
                      long_poll_seconds=long_poll_seconds, max_request_bytes=config.storage.max_request_bytes,
                      tinker_client_config=sdk_flags())


def create_app(config: ServerConfig, broker_url: str, *, long_poll_seconds: float = 30.0) -> FastAPI:
    ctx = build_context(config, broker_url, long_poll_seconds=long_poll_seconds)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctx.store.refresh_broker_identity()
        await ctx.hub.start()
        # ops past their queue_timeout fail while still queued, behind a frozen worker too (one API process a round)
        sweeping = QueueTimeoutSweep(blocking_client(broker_url), ctx.keys, ctx.store.lost.queue_timeouts,
                                     ttl=config.storage.future_ttl_seconds).start()
        # What start-up built lives as long as the process: out of the collector's sight, a full collection
        # scans only what requests made (tens of ms less per pass under load).
        gc.collect()
        gc.freeze()
        if ctx.auth.dev_mode:
            said = os.environ.get(launched_process.DEV_MODE_SAID_ENV) == "1"  # by the launcher, on its terminal
            log.log(logging.INFO if said else logging.WARNING,
                    "no API keys configured: DEV MODE, every key is accepted as its own tenant")
        yield
        sweeping.set()
        await ctx.hub.close()
        await ctx.store.close()

    app = FastAPI(title="Twinkle", version="0.1.0", lifespan=lifespan, default_response_class=FiniteJSONResponse,
                  responses=ERROR_RESPONSES,
                  description="Training as a service: many LoRA adapters on one base model.")
    app.state.ctx = ctx
    error_answers = errors.install(app)
    prefix = api_prefix(config)
    # Routes are matched in order, one at a time: the ones every op calls first (the long-poll, the compute submits).
    for module in (futures, training, sampling, session, rest, exports, imports, downloads, tokenizer, twinkle,
                   usage):
        app.include_router(module.router, prefix=prefix)
    # /v1/...: where OpenAI clients look, whatever the prefix; its errors in OpenAI's shape
    app.include_router(openai_routes.router, responses=OPENAI_ERROR_RESPONSES)
    app.include_router(console_routes.router)  # /console
    setup_api_telemetry(app, config)
    # innermost: parks retrieve_future polls after the body checks, before the framework builds a request
    app.add_middleware(LongPolls, ctx=ctx, path=f"{prefix}/retrieve_future", answer_ended=not config.telemetry.enabled)
    # innermost too: answers the training submits, before the framework builds a request
    app.add_middleware(Submits, ctx=ctx, prefix=prefix, errors=error_answers, enabled=not config.telemetry.enabled)
    app.add_middleware(BodyLimit, max_bytes=config.storage.max_request_bytes,
                       max_control_bytes=config.storage.max_control_request_bytes,
                       max_upload_bytes=config.storage.max_adapter_upload_bytes)
    app.add_middleware(KeyShare)  # inside the access log, so a request's wait for its key's slot is timed
    app.add_middleware(AccessLog)  # added last: outermost, so it times and logs every answer
    return app
