"""Every error Twinkle raises on purpose.

    TwinkleError                      root; carries a category and a hint
    ├── UserError                     the caller can fix it (HTTP 4xx, future category "user")
    │   ├── InvalidRequest            malformed or out-of-range input (400)
    │   ├── Unauthenticated           missing or unknown API key (401)
    │   ├── NotFound                  unknown id, or an id owned by another key (404)
    │   ├── Expired                   a future or resource that existed but has expired (410)
    │   ├── PayloadTooLarge           request body over the configured limit (413)
    │   ├── RateLimited               over a rate or token limit; retry later (429)
    │   ├── LimitExceeded             a hard quota (models per key, LoRA slots) (429)
    │   ├── QuotaExceeded             a tier's quota (tokens, pool time, training runs); not retried (403)
    │   ├── AdapterGone               the adapter was unloaded (idle, lifetime, explicit) (404)
    │   └── LaunchAlreadyRuns         a running launch on this machine already runs these pool replicas
    └── ServerError                   Twinkle or its infrastructure failed (HTTP 5xx, category "server")
        ├── AdapterStateLost          a worker crashed and the adapter's in-memory state is gone
        ├── BrokerUnavailable         Redis/Valkey cannot be reached (503)
        ├── BackendFailure            the model backend raised unexpectedly
        ├── StorageFailure            the checkpoint disk is full, read-only or not writable (507)
        ├── ExportStoreFailure        the S3-compatible export store is unreachable or refuses access (502)
        ├── ExportVerificationFailed  a merged export does not reproduce its checkpoint's logprobs (409)
        └── PoolLeaseHeld             another worker consumes this pool's queue (a pool worker refuses to start)

Errors cross process boundaries (Celery, Redis blobs), so each one pickles with its fields intact.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

Category = Literal["user", "server"]


class TwinkleError(Exception):
    """Raised for any failure Twinkle reports to a client."""

    category: ClassVar[Category] = "server"
    status_code: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.hint, self.details))

    def __str__(self) -> str:
        return f"{self.message} {self.hint}" if self.hint else self.message

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape clients see: never a traceback, never a server path."""
        body: dict[str, Any] = {"error": str(self), "category": self.category, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def _rebuild(cls: type[TwinkleError], message: str, hint: str | None, details: dict[str, Any]) -> TwinkleError:
    return cls(message, hint=hint, **details)


class UserError(TwinkleError):
    """Raised when the request itself is at fault; resubmitting it unchanged fails again."""

    category = "user"
    status_code = 400
    code = "invalid_request"


class InvalidRequest(UserError):
    """Raised when input is malformed, mistyped or out of range."""


class Unauthenticated(UserError):
    """Raised when a request has no API key or one the server does not know."""

    status_code = 401
    code = "unauthenticated"


class NotFound(UserError):
    """Raised for unknown ids and for ids that belong to another API key (never 403: no oracle)."""

    status_code = 404
    code = "not_found"


class Forbidden(UserError):
    """Raised for a signed download URL that is expired, altered or signed for someone else."""

    status_code = 403
    code = "forbidden"


class Expired(UserError):
    """Raised for a future or resource whose retention period has passed."""

    status_code = 410
    code = "expired"


class PayloadTooLarge(UserError):
    """Raised when a request body exceeds the server's size limit."""

    status_code = 413
    code = "payload_too_large"


class RateLimited(UserError):
    """Raised when a key exceeds its request or token rate; retry after `retry_after` seconds."""

    status_code = 429
    code = "rate_limited"


class LimitExceeded(UserError):
    """Raised when a hard quota is reached (models per key, LoRA slots on every replica)."""

    status_code = 429
    code = "limit_exceeded"


class QuotaExceeded(UserError):
    """Raised when an API key has used up a quota of its tier (`tenancy.tiers`): a metered quantity per day,
    month or ever, or its active training runs. 403, not 429 or 402, so the Tinker SDK raises at once instead
    of retrying for minutes; the message names the quantity, what was used, the limit and when it resets."""

    status_code = 403
    code = "quota_exceeded"


class AdapterGone(UserError):
    """Raised for ops on an adapter that was unloaded (idle timeout, lifetime, explicit unload)."""

    status_code = 404
    code = "adapter_gone"


class PoolReserved(UserError):
    """Raised when an op needs a pool that a full-parameter run holds exclusively (`full_finetune`), where the pool
    refuses instead of queueing (`full_finetune.while_reserved: refuse`), or when a second full run asks for a
    pool already held. 423, not 409 or 503, so the Tinker SDK raises at once instead of retrying for minutes; the
    message says until when the lease runs."""

    status_code = 423
    code = "pool_reserved"


class LaunchAlreadyRuns(UserError):
    """Raised when `twinkle-server launch` would start pool replicas that a running launch on this machine runs:
    a second consumer of a queue would take messages the first one holds."""

    code = "launch_already_runs"


class ServerError(TwinkleError):
    """Raised when Twinkle, not the caller, is at fault."""


class AdapterStateLost(ServerError):
    """Raised when a worker restarted and an adapter's weights and optimizer state were lost."""

    code = "adapter_state_lost"


class BrokerUnavailable(ServerError):
    """Raised when the broker (Redis/Valkey) cannot be reached."""

    status_code = 503
    code = "broker_unavailable"


class BackendFailure(ServerError):
    """Raised when a backend op fails for a reason that is not the caller's input."""

    code = "backend_failure"


class StorageFailure(ServerError):
    """Raised when the checkpoint disk is full, read-only or refuses access: the operator's to fix (507)."""

    status_code = 507
    code = "storage_unavailable"


class ExportStoreFailure(ServerError):
    """Raised when the S3-compatible bucket that serves checkpoint downloads (storage.export_store) cannot be
    reached, does not exist or refuses the server's credentials: the operator's to fix (502)."""

    status_code = 502
    code = "export_store_unavailable"


class ExportVerificationFailed(ServerError):
    """Raised when a merged export, loaded the way a user loads it, does not give its checkpoint's logprobs within
    the tolerance: the export is kept as failed and never offered for download (409)."""

    status_code = 409
    code = "export_verification_failed"


class PoolLeaseHeld(ServerError):
    """Raised when a pool worker starts while another live worker holds its queue's lease (twinkle/pool_lease.py):
    two consumers of one queue would split an adapter's ops between two copies of its state."""

    code = "pool_lease_held"


class OpTimedOut(BackendFailure):
    """Raised when an op ran past its pool's execution_timeout, or its worker froze while running it."""

    code = "execution_timeout"


class QueueTimedOut(ServerError):
    """Raised when an op waited in its pool's queue longer than queue_timeout and was not run."""

    code = "queue_timeout"


def lost_state_error(model_id: str, last_checkpoint: str | None) -> AdapterStateLost:
    """The error for ops on an adapter whose in-memory state died with its worker."""
    if last_checkpoint:
        hint = f"Resume from the last checkpoint {last_checkpoint} (load_state) and repeat the lost steps."
    else:
        hint = "No checkpoint of this adapter exists; create a new model and train again."
    return AdapterStateLost(
        f"The worker holding model {model_id} restarted and its in-memory state was lost.",
        hint=hint,
        model_id=model_id,
        last_checkpoint=last_checkpoint,
    )
