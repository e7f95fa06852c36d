"""Everything a request handler needs, built once per API process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.checkpoint_writes import CheckpointWrites
from api.hub import FutureHub
from api.pool_state import PoolState
from api.quotas import QuotaGate
from api.ratelimit import RateLimiter
from api.stability_records import StabilityRecords
from api.store import Store
from api.usage_history import UsageHistory
from twinkle.auth import KeyChecker
from twinkle.catalog import Catalog, ServedModel
from twinkle.checkpoints import CheckpointStore
from twinkle.download_urls import DownloadSigner
from twinkle.export_store import ExportStore
from twinkle.keys import Keys

if TYPE_CHECKING:
    from twinkle.config.server_config import ServerConfig

MODEL_INFO_SECONDS = 1.0  # how long a pool's published model info is reused before it is read again


@dataclass
class ApiContext:
    config: ServerConfig
    store: Store
    hub: FutureHub
    catalog: Catalog
    keys: Keys
    auth: KeyChecker
    checkpoints: CheckpointStore
    limiter: RateLimiter
    quotas: QuotaGate
    pools: PoolState  # what the pools publish and hold
    stability: StabilityRecords  # sample requests recorded for stable_reinforce
    usage_history: UsageHistory  # the usage ledger, for reports
    long_poll_seconds: float = 30.0
    max_request_bytes: int = 64 << 20
    tinker_client_config: dict[str, Any] = field(default_factory=dict)  # what /client/config answers (api/sdk_flags.py)
    writes: CheckpointWrites | None = None  # the per-key cap on outstanding checkpoint saves
    downloads: DownloadSigner | None = None  # signs download URLs; made on first use (api/services/downloads.py)
    export_store: ExportStore | None = None  # set: downloads come from an S3-compatible bucket instead

    _model_infos: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    async def model_info(self, served: ServedModel) -> dict[str, Any] | None:
        """What the pool published about its loaded model (vocab size, context length, tokenizer).

        Every forward_backward and sample checks its tokens against it: read at most once a second (a pool
        publishes it when it starts, and serves the configured model until it stops), not once a request."""
        app = served.model_app or served.sampler_app
        if app is None:
            return None
        now = time.monotonic()
        cached = self._model_infos.get(app)
        if cached is not None and now - cached[0] < MODEL_INFO_SECONDS:
            return cached[1]
        info = await self.pools.model_info(app)
        if info is None:
            return None  # no pool has started yet: ask again next time
        self._model_infos[app] = (now, info)
        return info

    def per_key_model_limit(self) -> int:
        server = self.config.server_app()
        return int(server.args.server_config.per_token_model_limit) if server else 0
