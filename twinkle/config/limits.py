"""Per-pool request limits and LoRA adapter lifetimes. Zero means "unlimited" wherever it is allowed."""

from __future__ import annotations

from pydantic import Field

from twinkle.config.base import StrictModel


class QueueConfig(StrictModel):
    """Admission control for one pool: rate limits per API key, input size, and waiting/running time."""

    enabled: bool = True
    """Apply the limits below; false admits every request."""
    rps_limit: float = Field(default=0, ge=0)
    """Requests per second per API key (0 = unlimited)."""
    tps_limit: float = Field(default=0, ge=0)
    """Input tokens per second per API key (0 = unlimited)."""
    max_input_tokens: int = Field(default=0, ge=0)
    """Largest number of input tokens in one request (0 = unlimited)."""
    window_seconds: float = Field(default=1, gt=0)
    """Length of the sliding window the rates are measured over, in seconds."""
    queue_timeout: float = Field(default=300, ge=0)
    """Seconds a task may wait in the queue before it fails (0 = forever)."""
    execution_timeout: float = Field(default=0, ge=0)
    """Seconds a task may run before it is reported as failed (0 = no limit)."""


class AdapterConfig(StrictModel):
    """Lifetimes and slots of the LoRA adapters a model or sampler pool holds."""

    adapter_timeout: float = Field(default=1800, gt=0)
    """Seconds without a heartbeat or request after which an adapter is unloaded."""
    adapter_max_lifetime: float = Field(default=36000, gt=0)
    """Seconds after creation at which an adapter is unloaded however busy it is."""
    max_loras: int = Field(default=8, ge=1)
    """Adapters one replica holds in its LoRA slots on the device; beyond them the least recently used are
    paged out to host memory, then disk, and paged back in on their next op."""
    page_host_mb: int = Field(default=4096, ge=0)
    """Host memory (MiB) per replica for adapters paged out of their slots; past it the least recently
    used go to disk (0 = straight to disk)."""
    page_disk_mb: int = Field(default=32768, ge=0)
    """Disk space (MiB) per replica for paged-out adapters; when it is full too, creating another adapter
    fails with a limit error (0 = no disk tier; both 0 make max_loras a hard limit)."""
    page_dir: str | None = None
    """Directory for adapters paged to disk (None = the system temp directory); each worker process
    writes into its own subdirectory, removed when it exits."""
    snapshot_interval: int = Field(default=0, ge=0)
    """Seconds between automatic snapshots of each adapter's weights and optimizer state, so a crashed
    worker can resume it (0 = no automatic snapshots)."""
