"""Every Redis key and channel Twinkle uses, in one place.

All keys start with `<key_prefix>tw:` so that `twinkle-server clear persistence` can remove exactly
Twinkle's keys and several deployments can share one Redis.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = ""

    @property
    def root(self) -> str:
        return f"{self.prefix}tw:"

    # futures and their payloads
    def future(self, request_id: str) -> str:
        return f"{self.root}future:{request_id}"

    def blob_in(self, request_id: str) -> str:
        return f"{self.root}blob:{request_id}:in"

    def blob_out(self, request_id: str) -> str:
        return f"{self.root}blob:{request_id}:out"

    def done_channel(self, request_id: str) -> str:
        return f"{self.root}done:{request_id}"

    def sample_stream(self, token: str) -> str:
        """Pub/sub channel a sampler pool publishes a streamed request's new tokens on (OpenAI streaming)."""
        return f"{self.root}stream:{token}"

    def dedupe(self, model_id: str, seq_id: int) -> str:
        return f"{self.root}dedupe:{model_id}:{seq_id}"

    def stability(self, request_id: str) -> str:
        """Hash recording a sample request made with record_stability_info (api.provenance), one day."""
        return f"{self.root}stability:{request_id}"

    def idempotency(self, owner: str, key: str) -> str:
        return f"{self.root}idem:{owner}:{key}"

    # queues: tickets handed out at publish, the last ticket a worker started
    def queue_tickets(self, queue: str) -> str:
        return f"{self.root}queue:{queue}:tickets"

    def queue_started(self, queue: str) -> str:
        return f"{self.root}queue:{queue}:started"

    # tenants' resources
    def session(self, session_id: str) -> str:
        return f"{self.root}session:{session_id}"

    def model(self, model_id: str) -> str:
        return f"{self.root}model:{model_id}"

    def owner_models(self, owner: str) -> str:
        return f"{self.root}owner:{owner}:models"

    def sampling_session(self, sampling_session_id: str) -> str:
        return f"{self.root}sampling:{sampling_session_id}"

    def owner_runs(self, owner: str) -> str:
        return f"{self.root}owner:{owner}:runs"

    def checkpoints(self, run_id: str) -> str:
        """Hash checkpoint_id -> JSON record of one training run's checkpoints."""
        return f"{self.root}run:{run_id}:checkpoints"

    def owner_sessions(self, owner: str) -> str:
        return f"{self.root}owner:{owner}:sessions"

    def owner_sampling_sessions(self, owner: str) -> str:
        """Set of one tenant's sampling session ids (the console lists them)."""
        return f"{self.root}owner:{owner}:sampling"

    def owner_futures(self, owner: str) -> str:
        """Sorted set of one tenant's most recent request ids, scored by submit time (the console's op list)."""
        return f"{self.root}owner:{owner}:futures"

    def run_metrics(self, run_id: str) -> str:
        """List of `<step> <json>` entries: each op's metrics on one training run, newest last, bounded."""
        return f"{self.root}run:{run_id}:metrics"

    def recent_errors(self) -> str:
        """List of JSON entries of the most recent failed ops, newest first, bounded (the admin console)."""
        return f"{self.root}errors:recent"

    # admission control
    def rate_window(self, owner: str, app: str, what: str) -> str:
        """Sorted set of one tenant's recent admitted requests (`what`="requests") or their input token
        counts ("tokens") on one pool, scored by time: the sliding window of api/ratelimit.py."""
        return f"{self.root}rate:{owner}:{app}:{what}"

    def checkpoint_writes(self, owner: str) -> str:
        """Sorted set of one tenant's outstanding checkpoint saves (request ids by submit time): the
        concurrency cap of api/checkpoint_writes.py."""
        return f"{self.root}checkpoint_writes:{owner}"

    def rate_rejections(self) -> str:
        """Hash `<app>:<reason>` -> number of requests admission control refused."""
        return f"{self.root}rate:rejections"

    # workers
    def pool_reservation(self, queue: str) -> str:
        """Hash: the full-parameter run holding the pool exclusively (twinkle.pool_reservation)."""
        return f"{self.root}pool:{queue}:reservation"

    def reservation_parked(self, queue: str) -> str:
        """List: broker messages of other runs' ops waiting out the pool's reservation, oldest first."""
        return f"{self.root}pool:{queue}:reservation:parked"

    def reservation_parked_ids(self, queue: str) -> str:
        """List: the request ids of `reservation_parked`, in the same order (an op's place among them)."""
        return f"{self.root}pool:{queue}:reservation:parked_ids"

    def pool_heartbeat(self, queue: str) -> str:
        return f"{self.root}pool:{queue}:heartbeat"

    def pool_adapters(self, queue: str) -> str:
        """Set of the adapters a model pool holds in its LoRA slots now (paged-out ones are not in it)."""
        return f"{self.root}pool:{queue}:adapters"

    def pool_paging(self, queue: str) -> str:
        """Hash of a model pool's paging counters (backends.paging.PagingStats), refreshed after each op."""
        return f"{self.root}pool:{queue}:paging"

    def pool_assigned(self, queue: str) -> str:
        """Set of active models pinned to a pool replica (assigned at create, removed at unload)."""
        return f"{self.root}pool:{queue}:assigned"

    def pool_info(self, app: str) -> str:
        """JSON ModelInfo a pool publishes once its model is loaded."""
        return f"{self.root}pool:{app}:info"

    def pool_lora_modules(self, app: str) -> str:
        """JSON of the linear layers (name -> [out, in]) a transformers pool's model has, for adapter imports."""
        return f"{self.root}pool:{app}:lora_modules"

    def pool_lease(self, queue: str) -> str:
        """Hash naming the one worker that may consume a pool queue (host, pid, since, token); it expires unless
        its holder renews it (twinkle/pool_lease.py)."""
        return f"{self.root}pool:{queue}:lease"

    def pool_lease_fence(self, queue: str) -> str:
        """The token of the latest worker to take a pool queue's lease; no expiry. A worker whose token it is not
        writes no outcome of an op (twinkle/pool_lease.py)."""
        return f"{self.root}pool:{queue}:lease:fence"
