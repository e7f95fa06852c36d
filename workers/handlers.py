"""What each op does on a pool: the glue between a future's payload and the backend."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from twinkle.backends.base import ModelBackend, SamplerBackend
from twinkle.checkpoints import CheckpointRef, CheckpointStore, index_entry, parse_checkpoint_path
from twinkle.encryption import encrypt_directory
from twinkle.errors import InvalidRequest
from twinkle.futures import FutureRecord, Op
from twinkle.keys import Keys
from twinkle.pool_reservation import PoolReservation
from twinkle.records import ModelRecord, SamplingSessionRecord
from twinkle.types import (
    AdamParams,
    ForwardBackwardInput,
    LoadRequest,
    LoraSpec,
    SampleOutput,
    SampleRequest,
    SaveRequest,
    input_length,
    lora_spec_from_dict,
)
from workers.batcher import SampleBatcher
from workers.exports import ExportSettings, MergedExports
from workers.residency import SlotResidency
from workers.token_stream import token_publisher
from workers.twinkle_ops import TwinkleOps

log = logging.getLogger("twinkle.worker")


class CheckpointIndex:
    """The Redis index of checkpoints per training run, read by the RestClient routes."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    def record(self, ref: CheckpointRef, metadata: dict[str, Any], ttl_seconds: int | None) -> None:
        entry = index_entry(ref, metadata, ttl_seconds)
        field = {"weights": "last_checkpoint", "sampler_weights": "last_sampler_checkpoint"}.get(ref.kind)
        pipe = self.r.pipeline()
        pipe.hset(self.keys.checkpoints(ref.run_id), ref.checkpoint_id, json.dumps(entry))
        if field:  # an external export is neither the run's resume point nor its sampler
            pipe.hset(self.keys.model(ref.run_id), field, ref.uri())
        pipe.execute()


class ModelPoolHandlers:
    """Ops of a model pool: one backend holding one base model and many adapters."""

    def __init__(self, backend: ModelBackend, sampler: SamplerBackend | None, store: CheckpointStore,
                 r: redis.Redis, keys: Keys, queue: str = "", exports: ExportSettings | None = None) -> None:
        self.backend = backend
        self.sampler = sampler
        self.store = store
        self.index = CheckpointIndex(r, keys)
        self.r = r
        self.keys = keys
        self.live_adapters: set[str] = set()  # resident in a LoRA slot or paged out (backends.paging)
        self.twinkle = TwinkleOps(self)
        self.queue = queue
        self.residency = SlotResidency(r, keys, queue, backend, lambda: self.live_adapters)
        self.exports = MergedExports(backend, store, r, keys, exports)
        self.reservation: PoolReservation | None = None  # set where the pool allows full-parameter runs

    def _create(self, rec: FutureRecord, spec: LoraSpec) -> None:
        """Create the run's adapter; a full-parameter run first takes the pool (twinkle.pool_reservation)."""
        if not spec.full:
            self.backend.create_adapter(rec.model_id, spec)
            return
        if self.reservation is None:
            raise InvalidRequest(f"Pool {self.queue} does not allow full-parameter runs.",
                                 hint="Create a LoRA run, or ask the operator for a pool with full_finetune enabled.")
        model = self._model(rec.model_id)
        self.reservation.take(rec, model.session_id if model else "")
        try:
            self.backend.create_adapter(rec.model_id, spec)
        except BaseException:
            self.reservation.end("the full run could not be created")
            raise

    def adapter_ids(self) -> list[str]:
        return sorted(self.live_adapters)

    def drop_adapter(self, adapter_id: str) -> None:
        self.backend.remove_adapter(adapter_id)
        self.live_adapters.discard(adapter_id)
        self.residency.publish()
        self.twinkle.forget(adapter_id)
        if self.reservation is not None and self.reservation.holder == adapter_id:
            self.reservation.end("the full run was unloaded")

    def end_full_run(self, model_id: str, why: str) -> None:
        """The run's hold of the pool is over (lease, cap, operator): unload it, as the adapter reaper does."""
        self.drop_adapter(model_id)
        pipe = self.r.pipeline()
        pipe.hset(self.keys.model(model_id), mapping={
            "status": "unloaded", "unload_reason": f"its exclusive hold of pool {self.queue} ended: {why}"})
        model = self._model(model_id)
        if model is not None:
            pipe.srem(self.keys.owner_models(model.owner), model_id)
            pipe.srem(self.keys.pool_assigned(model.queue), model_id)
        pipe.execute()
        log.info("full-parameter run %s unloaded: %s", model_id, why)

    def _hold(self, adapter_id: str) -> None:
        self.live_adapters.add(adapter_id)
        self.residency.publish()

    def table(self) -> dict[str, Any]:
        return {op: self.residency.after(handler) for op, handler in self._ops().items()}

    def _ops(self) -> dict[str, Any]:
        return {
            Op.CREATE_MODEL: self.create_model,
            Op.FORWARD: self.forward,
            Op.FORWARD_BACKWARD: self.forward_backward,
            Op.OPTIM_STEP: self.optim_step,
            Op.SAVE_STATE: self.save,
            Op.SAVE_WEIGHTS_FOR_SAMPLER: self.save,
            Op.SAVE_WEIGHTS_EXTERNAL: self.save,
            Op.LOAD_STATE: self.load_state,
            Op.SAMPLE: self.sample,
            Op.UNLOAD_MODEL: self.unload_model,
            Op.CONFIGURE: self.twinkle.configure,
            Op.CLIP_GRAD_AND_STEP: self.twinkle.clip_grad_and_step,
            Op.CALCULATE_METRIC: self.twinkle.calculate_metric,
            Op.GET_TRAIN_CONFIGS: self.twinkle.get_train_configs,
            Op.UPLOAD_TO_HUB: self.upload_to_hub,
            Op.EXPORT_MERGED: self.exports.export,
        }

    def create_model(self, rec: FutureRecord, spec: LoraSpec) -> dict[str, Any]:
        self._create(rec, spec)
        self._hold(rec.model_id)
        self.twinkle.forget(rec.model_id)
        return {"model_id": rec.model_id}

    def forward(self, rec: FutureRecord, batch: ForwardBackwardInput | dict[str, Any]) -> Any:
        if isinstance(batch, dict):  # Twinkle-native inputs
            return self.twinkle.forward_only(rec, batch)
        return self.backend.forward(rec.model_id, batch)

    def forward_backward(self, rec: FutureRecord, batch: ForwardBackwardInput | dict[str, Any]) -> Any:
        if isinstance(batch, dict):
            return self.twinkle.forward_backward(rec, batch)
        return self.backend.forward_backward(rec.model_id, batch)

    def optim_step(self, rec: FutureRecord, params: AdamParams) -> dict[str, Any]:
        return {"metrics": self.backend.optim_step(rec.model_id, params)}

    def save(self, rec: FutureRecord, req: SaveRequest) -> dict[str, Any]:
        ref = CheckpointRef(rec.model_id, req.kind, req.name)
        tmp = self.store.begin(rec.owner, ref)
        try:
            if req.kind == "weights":
                self.backend.save_state(rec.model_id, tmp, include_optimizer=req.include_optimizer)
                self.twinkle.write_trainer_state(rec.model_id, tmp, req.consumed_train_samples)
            else:
                self.backend.save_weights_for_sampler(rec.model_id, tmp)
            if req.age_recipients:
                encrypt_directory(tmp, req.age_recipients)
            model = self._model(rec.model_id)
            metadata = self.store.commit(rec.owner, ref, tmp, {
                "checkpoint_id": ref.checkpoint_id,
                "checkpoint_type": ref.checkpoint_type,
                "tinker_path": ref.uri(),
                "run_id": rec.model_id,
                "base_model": model.base_model if model else "",
                "lora": model.lora if model else {},
                "include_optimizer": req.include_optimizer and req.kind == "weights",
                "user_metadata": req.user_metadata,
                "progress": self.twinkle.trainer(rec.model_id).progress(),
                "time": time.time(),
            }, overwrite=req.overwrite)
        except BaseException:
            self.store.abort(tmp)
            raise
        self.index.record(ref, metadata, req.ttl_seconds)
        result: dict[str, Any] = {"path": ref.uri()}
        if ref.kind == "external_weights":
            result["size_bytes"] = metadata.get("size_bytes")
            full = bool(model and model.lora.get("mode") == "full")
            if not req.age_recipients and not full:  # a PEFT adapter download: checked as a user would load it
                check = self._check_adapter_export(rec, ref)
                if check is not None:
                    result["export"] = check
        if req.sampling_session_id:
            self._create_sampling_session(rec, req.sampling_session_id, ref)
            result["sampling_session_id"] = req.sampling_session_id
        return result

    def _check_adapter_export(self, rec: FutureRecord, ref: CheckpointRef) -> dict[str, Any] | None:
        """The saved adapter's check (workers.exports); a check that cannot run never fails the save it follows."""
        try:
            return self.exports.check_adapter(rec, ref)
        except Exception:  # the checkpoint is saved; only its listing lacks the check
            log.warning("the adapter check of %s did not run", ref.uri(), exc_info=True)
            return None

    def _create_sampling_session(self, rec: FutureRecord, sampling_session_id: str, ref: CheckpointRef) -> None:
        model = self._model(rec.model_id)
        session = SamplingSessionRecord(
            sampling_session_id=sampling_session_id, owner=rec.owner,
            session_id=model.session_id if model else "", base_model=model.base_model if model else "",
            queue=rec.queue, model_path=ref.uri(), created_at=time.time(),
        )
        pipe = self.r.pipeline()
        pipe.hset(self.keys.sampling_session(sampling_session_id), mapping=session.to_hash())
        pipe.sadd(self.keys.owner_sampling_sessions(rec.owner), sampling_session_id)
        pipe.execute()

    def load_state(self, rec: FutureRecord, req: LoadRequest) -> dict[str, Any]:
        ref = parse_checkpoint_path(req.path)
        directory = self.store.existing(req.owner, ref)
        if ref.kind != "weights" and req.include_optimizer:
            raise InvalidRequest("Sampler checkpoints hold no optimizer state.",
                                 hint="Load a training checkpoint (…/weights/<name>) to restore the optimizer.")
        if not self.backend.has_adapter(rec.model_id):
            metadata = self.store.metadata(req.owner, ref)  # never through a symlink
            spec = req.lora or lora_spec_from_dict(metadata.get("lora") or {})
            self._create(rec, spec)
            self._hold(rec.model_id)
        self.backend.load_state(rec.model_id, directory, include_optimizer=req.include_optimizer)
        result: dict[str, Any] = {"path": req.path, "model_id": rec.model_id}
        if req.restore_trainer:
            result["progress"] = self.twinkle.restore_trainer_state(rec.model_id, directory,
                                                                    only_model=req.only_model)
        return result

    def upload_to_hub(self, rec: FutureRecord, req: dict[str, Any]) -> dict[str, Any]:
        from twinkle.hub_upload import upload_checkpoint

        directory = self.store.existing(rec.owner, parse_checkpoint_path(req["checkpoint_path"]))
        return upload_checkpoint(directory, req["hub_model_id"], token=req.get("hub_token"),
                                 private=bool(req.get("private", True)))

    def sample(self, rec: FutureRecord, req: SampleRequest) -> SampleOutput:
        if req.adapter_path is None and rec.model_id and self.backend.has_adapter(rec.model_id):
            out = self.backend.sample(rec.model_id, [req])[0]
        elif self.sampler is None:
            out = self.backend.sample(None, [req])[0]
        else:
            out = self.sampler.sample([req])[0]
        out.prompt_length = out.prompt_length or input_length(req.prompt)
        return out

    def unload_model(self, rec: FutureRecord, _: Any) -> dict[str, Any]:
        self.drop_adapter(rec.model_id)
        return {"model_id": rec.model_id}

    def _model(self, model_id: str) -> ModelRecord | None:
        raw = self.r.hgetall(self.keys.model(model_id))
        return ModelRecord.from_hash(raw) if raw else None


class SamplerPoolHandlers:
    """A sampler pool serves several sample tasks at once through one batcher."""

    def __init__(self, sampler: SamplerBackend, max_batch: int, r: redis.Redis | None = None, *,
                 fair: bool = True) -> None:
        self.batcher = SampleBatcher(sampler, max_batch, fair=fair)
        self.r = r  # publishes the tokens of streamed requests as they are generated

    def table(self) -> dict[str, Any]:
        return {Op.SAMPLE: self.sample}

    def sample(self, rec: FutureRecord, req: SampleRequest) -> SampleOutput:
        stream = getattr(req, "stream_channel", None)  # payloads queued before the field existed lack it
        progress = token_publisher(self.r, stream) if stream and self.r is not None else None
        out = self.batcher.sample(req, progress, tenant=rec.owner, weight=rec.weight)
        out.prompt_length = out.prompt_length or input_length(req.prompt)
        return out
