"""The FastAPI application: one per API process, stateless apart from its Redis connections."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI

from api import errors
from api.context import ApiContext
from api.hub import FutureHub
from api.ratelimit import RateLimiter
from api.routes import futures, rest, sampling, session, training, twinkle
from api.store import Store
from twinkle.auth import KeyChecker
from twinkle.catalog import Catalog
from twinkle.celery_app import make_celery
from twinkle.checkpoints import CheckpointStore
from twinkle.keys import Keys
from twinkle.telemetry import setup_api_telemetry

log = logging.getLogger("twinkle.api")
DEFAULT_PREFIX = "/api/v1"


def api_prefix(config: Any) -> str:
    server = config.server_app()
    return (server.route_prefix if server else DEFAULT_PREFIX).rstrip("/") or DEFAULT_PREFIX


def build_context(config: Any, broker_url: str, *, long_poll_seconds: float = 30.0) -> ApiContext:
    r = aioredis.Redis.from_url(broker_url, max_connections=512, health_check_interval=25)
    keys = Keys(config.persistence.key_prefix)
    server = config.server_app()
    session_ttl = int(server.args.server_config.expiration_timeout) if server else 86400
    celery = make_celery(broker_url, events=config.flower.enabled)
    store = Store(r, keys, celery, future_ttl=config.storage.future_ttl_seconds, session_ttl=session_ttl)
    auth = KeyChecker(set(config.auth.api_keys), config.auth.keys_file)
    catalog = Catalog(config)
    return ApiContext(config=config, store=store, hub=FutureHub(r), catalog=catalog, keys=keys, auth=auth,
                      checkpoints=CheckpointStore(config.storage.checkpoint_dir),
                      limiter=RateLimiter.from_config(r, keys, config, catalog),
                      long_poll_seconds=long_poll_seconds, max_request_bytes=config.storage.max_request_bytes,
                      tinker_client_config=json.loads(os.environ.get("TWINKLE_TINKER_CLIENT_CONFIG") or "{}"))


def create_app(config: Any, broker_url: str, *, long_poll_seconds: float = 30.0) -> FastAPI:
    ctx = build_context(config, broker_url, long_poll_seconds=long_poll_seconds)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctx.store.refresh_broker_identity()
        await ctx.hub.start()
        if ctx.auth.dev_mode:
            log.warning("no API keys configured: DEV MODE, every key is accepted as its own tenant")
        yield
        await ctx.hub.close()
        await ctx.store.r.aclose()

    app = FastAPI(title="Twinkle", version="0.1.0", lifespan=lifespan,
                  description="Training as a service: many LoRA adapters on one base model.")
    app.state.ctx = ctx
    errors.install(app)
    prefix = api_prefix(config)
    for module in (session, training, sampling, futures, rest, twinkle):
        app.include_router(module.router, prefix=prefix)
    setup_api_telemetry(app, config)
    return app
