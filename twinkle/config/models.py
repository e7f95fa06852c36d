"""The top-level sections of the server config: network, telemetry, state, broker, storage, access."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from twinkle.config.base import StrictModel, config_problem

ProxyLocation = Literal["EveryNode", "HeadOnly"]
PersistenceMode = Literal["memory", "file", "redis"]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _check_redis_url(url: str | None) -> str | None:
    if url is not None and not url.startswith(_REDIS_SCHEMES):
        raise config_problem(
            f"{url!r} is not a Redis URL",
            hint="write it as redis://HOST:PORT[/DB], rediss://... for TLS, or unix:///path/to/socket",
        )
    return url


def _sha256_hex(key: str) -> str:
    normalised = key.strip().lower()
    if not _SHA256_HEX.match(normalised):
        raise config_problem(
            "not a SHA-256 hex digest (64 hex characters); raw keys must never be stored",
            hint="store hashlib.sha256(KEY.encode()).hexdigest() instead of the key itself",
        )
    return normalised


ApiKeyHash = Annotated[str, AfterValidator(_sha256_hex)]


class HttpOptions(StrictModel):
    """Where the HTTP API listens."""

    host: str = "127.0.0.1"
    """Interface to bind; the default only accepts local connections, use 0.0.0.0 to accept all."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port of the API (0 asks the operating system for a free port)."""


class TelemetryConfig(StrictModel):
    """OpenTelemetry traces, metrics and logs, pushed over OTLP."""

    enabled: bool = False
    """Whether to export telemetry at all."""
    service_name: str = "twinkle-server"
    """The `service.name` resource attribute every span and metric carries."""
    otlp_endpoint: str = "http://localhost:4317"
    """gRPC address of the OpenTelemetry collector; it must be reachable from every Twinkle process."""
    debug: bool = False
    """Print spans and metrics to the console instead of sending them over OTLP."""
    export_interval_ms: int = Field(default=30000, gt=0)
    """How often metrics are exported, in milliseconds."""
    resource_attributes: dict[str, str] = Field(default_factory=dict)
    """Extra resource attributes attached to all telemetry (for example `deployment.environment`)."""


class PersistenceConfig(StrictModel):
    """Where durable server state (sessions, models, training runs, checkpoint index) lives."""

    mode: PersistenceMode = "memory"
    """`memory`: in the broker's Redis, gone with it; `file`: JSON snapshot at `file_path`, restored at
    launch; `redis`: an external Redis at `redis_url`."""
    file_path: str | None = None
    """JSON snapshot file; required when mode is `file`."""
    redis_url: str | None = None
    """Redis URL such as `redis://localhost:6379/0`; required when mode is `redis`."""
    key_prefix: str = ""
    """Prefix for every key Twinkle writes, so several servers can share one Redis database."""

    @field_validator("redis_url")
    @classmethod
    def _redis_url_has_scheme(cls, url: str | None) -> str | None:
        return _check_redis_url(url)

    @model_validator(mode="after")
    def _mode_has_its_location(self) -> PersistenceConfig:
        if self.mode == "file" and not self.file_path:
            raise config_problem(
                "required when persistence.mode is 'file'",
                subpath="file_path",
                hint="set persistence.file_path to a JSON file, e.g. /var/lib/twinkle/state.json",
            )
        if self.mode == "redis" and not self.redis_url:
            raise config_problem(
                "required when persistence.mode is 'redis'",
                subpath="redis_url",
                hint="set persistence.redis_url, e.g. redis://localhost:6379",
            )
        return self


class BrokerConfig(StrictModel):
    """The Redis/Valkey server that carries Celery queues, futures and payloads."""

    url: str | None = None
    """Redis URL of an existing broker; None makes `launch` start an embedded Valkey on this machine."""
    db: int = Field(default=0, ge=0)
    """Redis database number used when `url` does not name one."""
    pool_lease_seconds: float = Field(default=15.0, ge=1.0, le=600.0)
    """How long a pool worker's claim on its queue lasts unless renewed (every fifth of it). A second worker for
    the same pool refuses to start while the claim holds; it takes over this long after the holder froze or its
    node died, at once when the holder's process on the same host is gone."""

    @field_validator("url")
    @classmethod
    def _url_has_scheme(cls, url: str | None) -> str | None:
        return _check_redis_url(url)


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ExportStoreConfig(StrictModel):
    """An S3-compatible bucket (AWS S3, MinIO, Ceph, R2, ...) that serves checkpoint downloads instead of the API.
    The keys come from the environment, never from this file."""

    bucket: str
    """Bucket the archives are uploaded to; it must exist (`launch` checks that it is reachable)."""
    endpoint_url: str | None = None
    """`http(s)://host:port` of an S3-compatible service such as MinIO; unset: AWS S3 of `region`. Download URLs
    point here, so clients must reach it."""
    region: str = "us-east-1"
    """Region the URLs are signed for (MinIO and most others accept the default)."""
    key_prefix: str = "twinkle/"
    """Prefix of every object key: `<key_prefix><tenant>/<run>/<kind>/<name>/...`."""
    addressing_style: Literal["path", "virtual"] | None = None
    """`path` (bucket in the URL path) or `virtual` (bucket in the host name); unset: `path` with an
    `endpoint_url`, `virtual` on AWS S3."""
    access_key_id_env: str = "AWS_ACCESS_KEY_ID"
    """Environment variable holding the access key id; with neither variable set, boto3's own chain (instance
    role, `~/.aws`) is used."""
    secret_access_key_env: str = "AWS_SECRET_ACCESS_KEY"
    """Environment variable holding the secret access key."""

    @field_validator("bucket")
    @classmethod
    def _bucket_name(cls, bucket: str) -> str:
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise config_problem(f"{bucket!r} is not a valid bucket name",
                                 hint="use 3-63 lowercase letters, digits, '.' and '-', e.g. twinkle-exports")
        return bucket

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_has_scheme(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise config_problem(f"{url!r} is not an HTTP URL", hint="write it as https://HOST[:PORT]")
        return url

    @field_validator("key_prefix")
    @classmethod
    def _relative_prefix(cls, prefix: str) -> str:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise config_problem(f"{prefix!r} is not a relative key prefix", hint="write it like twinkle/")
        return prefix

    @field_validator("access_key_id_env", "secret_access_key_env")
    @classmethod
    def _env_name(cls, name: str) -> str:
        if not _ENV_NAME.fullmatch(name):
            raise config_problem(f"{name!r} is not an environment variable name",
                                 hint="name the variable (AWS_SECRET_ACCESS_KEY), never the key itself")
        return name


class StorageConfig(StrictModel):
    """Checkpoints on disk and retention of request payloads."""

    checkpoint_dir: str = "./outputs"
    """Root directory for checkpoints: `<checkpoint_dir>/<tenant>/<run>/{weights,sampler_weights}/<name>`."""
    future_ttl_seconds: int = Field(default=86400, gt=0)
    """How long a finished future and its result stay retrievable, in seconds."""
    max_request_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    """Largest accepted body of a compute request (forward, forward_backward, sampling, encode) in bytes;
    larger requests are refused with HTTP 413 while they arrive, before they are buffered."""
    max_control_request_bytes: int = Field(default=1024 * 1024, gt=0)
    """Largest accepted body of every other route (sessions, models, checkpoints, futures) in bytes; larger
    requests are refused with HTTP 413 while they arrive."""
    max_adapter_upload_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)
    """Largest accepted adapter upload (`POST /import_adapter`: a tar of a PEFT adapter's adapter_config.json and
    adapter_model.safetensors) in bytes, compressed or not; larger uploads are refused with HTTP 413 while they
    arrive, and an archive that unpacks to more is refused with 400."""
    checkpoint_writes_per_key: int = Field(default=2, ge=0)
    """Checkpoint saves (save_weights, save_state, save_weights_for_sampler, Twinkle save) one API key may
    have queued or running at once; more are refused with 429 and Retry-After (0 = unlimited)."""
    download_url_ttl_seconds: int = Field(default=3600, ge=60, le=7 * 86400)
    """Lifetime of the signed checkpoint download URLs the API hands out (external weights, archives)."""
    download_secret: str | None = Field(default=None, min_length=16)
    """HMAC key that signs download URLs; all API replicas need the same one. Unset: generated once and
    kept in `<checkpoint_dir>/.download_secret`."""
    public_url: str | None = None
    """Base URL clients reach the API at (e.g. `https://twinkle.example.org`), used in download URLs.
    Unset: the scheme and host the request came in on."""
    export_store: ExportStoreConfig | None = None
    """Serve checkpoint archives and external weight files from an S3-compatible bucket (presigned URLs with the
    same lifetime) instead of the API; unset: the API serves them."""


class AuthConfig(StrictModel):
    """API keys. With neither `api_keys` nor `keys_file` the server runs in development mode, where any
    key is accepted and each distinct key is its own tenant."""

    api_keys: list[ApiKeyHash] = Field(default_factory=list)
    """SHA-256 hex digests of the accepted API keys (never the raw keys)."""
    keys_file: str | None = None
    """File holding more key hashes, managed by `twinkle-server keys`."""
    admin_keys: list[ApiKeyHash] = Field(default_factory=list)
    """SHA-256 hex digests of operator keys: accepted like `api_keys`, and the web console shows their holders
    every pool (adapters, queue depths, recent errors) besides their own resources."""

    @property
    def dev_mode(self) -> bool:
        """True when no key source is configured and every key is accepted."""
        return not self.api_keys and not self.admin_keys and self.keys_file is None


class FlowerConfig(StrictModel):
    """Flower, the Celery monitoring UI, started by `launch` when enabled."""

    enabled: bool = False
    """Start Flower next to the workers."""
    port: int = Field(default=5555, ge=0, le=65535)
    """Port of the Flower web UI."""
    basic_auth: str | None = None
    """`user:password` protecting the Flower UI; None leaves it open."""

    @field_validator("basic_auth")
    @classmethod
    def _user_and_password(cls, value: str | None) -> str | None:
        if value is not None:
            user, colon, password = value.partition(":")
            if not (user and colon and password):
                raise config_problem("must look like 'user:password'")
        return value


class RayConfig(StrictModel):
    """How Twinkle reaches Ray, which places multi-GPU worker pools."""

    address: str | None = None
    """Address of a running Ray cluster (`auto`, or `HOST:PORT`); None starts Ray locally when a pool
    needs it."""
