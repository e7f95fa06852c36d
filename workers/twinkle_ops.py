"""Twinkle-native ops on a model pool: the server-side training loop pieces of `twinkle_client`.

A Twinkle client sends InputFeatures (or Trajectories) and names its loss, optimizer and schedule
once; this module turns each call into backend ops through the adapter's `twinkle.trainer` state.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from twinkle.errors import InvalidRequest
from twinkle.futures import FutureRecord
from twinkle.hyperparameters import check_adam_params
from twinkle.trainer import TrainConfig, TrainerState, adam_params
from twinkle.types import Datum, ForwardBackwardInput, ForwardBackwardOutput

TRAINER_STATE_FILE = "twinkle_trainer.json"  # the backends own trainer_state.json


class AdapterTrainer:
    def __init__(self) -> None:
        self.config = TrainConfig()
        self.state = TrainerState()

    def to_json(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "state": asdict(self.state)}

    def restore(self, saved: dict[str, Any], *, only_model: bool) -> None:
        if not only_model:
            self.config = TrainConfig(**saved.get("config", {}))
        self.state = TrainerState(**saved.get("state", {}))

    def progress(self) -> dict[str, int]:
        return {"cur_step": self.state.cur_step, "consumed_train_samples": self.state.consumed_train_samples,
                "gradient_accumulation_steps": self.config.gradient_accumulation_steps}


def _aligned(values: Any, n_targets: int, n_inputs: int, name: str) -> np.ndarray:
    """A per-target-token array from a scalar, a per-input-token or a per-target-token list."""
    array = np.asarray(values, dtype=np.float32).reshape(-1)
    if array.size == 1:
        return np.full(n_targets, float(array[0]), np.float32)
    if array.size == n_inputs:
        return array[1:]
    if array.size == n_targets:
        return array
    raise InvalidRequest(f"{name} has {array.size} values; expected 1, {n_inputs} (input tokens) or "
                         f"{n_targets} (target tokens).")


def datum_of(feature: dict[str, Any]) -> Datum:
    from twinkle.input_feature import datum_from_input_feature

    # Vision arrays (pixel_values, image_grid_thw, ...) ride along for the backend's forward.
    arrays = {k: np.asarray(v) for k, v in feature.items()
              if k in ("input_ids", "labels", "attention_mask") or k.startswith(("pixel_", "image_", "video_"))}
    datum = datum_from_input_feature(arrays)
    n_inputs = len(arrays["input_ids"])
    n_targets = n_inputs - 1
    if "advantages" in feature:
        datum.loss_fn_inputs["advantages"] = _aligned(feature["advantages"], n_targets, n_inputs, "advantages")
    for key in ("old_logps", "logprobs"):
        if key in feature:
            datum.loss_fn_inputs["logprobs"] = _aligned(feature[key], n_targets, n_inputs, key)
    return datum


class TwinkleOps:
    """Handlers of the Twinkle-native ops, sharing the pool's backend and checkpoint store."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool  # workers.handlers.ModelPoolHandlers
        self.trainers: dict[str, AdapterTrainer] = {}
        self._templates: dict[str, Any] = {}

    def trainer(self, model_id: str) -> AdapterTrainer:
        return self.trainers.setdefault(model_id, AdapterTrainer())

    def forget(self, model_id: str) -> None:
        self.trainers.pop(model_id, None)

    # -- ops -------------------------------------------------------------------------------------

    def configure(self, rec: FutureRecord, changes: dict[str, Any]) -> dict[str, Any]:
        trainer = self.trainer(rec.model_id)
        trainer.config.apply(changes)
        if changes.get("template"):
            self._template(trainer.config)  # fail now, not at the first forward_backward
        return {"train_config": asdict(trainer.config)}

    def get_train_configs(self, rec: FutureRecord, _: Any) -> dict[str, Any]:
        return {"train_config": asdict(self.trainer(rec.model_id).config), **self.trainer(rec.model_id).progress()}

    def forward_backward(self, rec: FutureRecord, payload: dict[str, Any]) -> dict[str, Any]:
        trainer = self.trainer(rec.model_id)
        batch = self._batch(trainer, payload)
        out = self.pool.backend.forward_backward(rec.model_id, batch)
        trainer.state.micro_steps += 1
        return self._summarise(trainer, batch, out, training=True)

    def forward_only(self, rec: FutureRecord, payload: dict[str, Any]) -> dict[str, Any]:
        trainer = self.trainer(rec.model_id)
        batch = replace(self._batch(trainer, payload), disable_lora=bool(payload.get("disable_lora")))
        return self._summarise(trainer, batch, self.pool.backend.forward(rec.model_id, batch), training=False)

    def clip_grad_and_step(self, rec: FutureRecord, payload: dict[str, Any]) -> dict[str, Any]:
        trainer = self.trainer(rec.model_id)
        cfg, state = trainer.config, trainer.state
        if state.micro_steps < cfg.gradient_accumulation_steps:
            return {"stepped": False, "cur_step": state.cur_step, "grad_norm": None, "lr": state.last_lr}
        params = check_adam_params(adam_params(cfg, state.cur_step, payload.get("max_grad_norm")), "optimizer")
        metrics = self.pool.backend.optim_step(rec.model_id, params)
        grad_norm = float(metrics.get("grad_norm:mean", 0.0))
        state.grad_norms.append(grad_norm)
        state.cur_step += 1
        state.micro_steps = 0
        state.last_lr = params.learning_rate
        return {"stepped": True, "cur_step": state.cur_step, "grad_norm": grad_norm, "lr": params.learning_rate}

    def calculate_metric(self, rec: FutureRecord, payload: dict[str, Any]) -> dict[str, Any]:
        state = self.trainer(rec.model_id).state
        result = {
            "loss": state.loss_sum / state.loss_tokens if state.loss_tokens else None,
            "grad_norm": float(np.mean(state.grad_norms)) if state.grad_norms else None,
            "lr": state.last_lr,
            "cur_step": state.cur_step,
            "tokens": int(state.loss_tokens),
            "is_training": bool(payload.get("is_training", True)),
        }
        state.loss_sum, state.loss_tokens, state.grad_norms = 0.0, 0.0, []
        return {"result": result}

    def write_trainer_state(self, model_id: str, directory: Path, consumed_train_samples: int | None) -> None:
        trainer = self.trainer(model_id)
        if consumed_train_samples is not None:
            trainer.state.consumed_train_samples = consumed_train_samples
        (directory / TRAINER_STATE_FILE).write_text(json.dumps(trainer.to_json(), indent=2))

    def restore_trainer_state(self, model_id: str, directory: Path, *, only_model: bool) -> dict[str, int]:
        trainer = self.trainer(model_id)
        path = directory / TRAINER_STATE_FILE
        if path.exists():
            trainer.restore(json.loads(path.read_text()), only_model=only_model)
        return trainer.progress()

    # -- helpers ---------------------------------------------------------------------------------

    def _batch(self, trainer: AdapterTrainer, payload: dict[str, Any]) -> ForwardBackwardInput:
        inputs = payload.get("inputs") or []
        if not inputs:
            raise InvalidRequest("forward_backward needs a non-empty list of inputs.")
        features = [self._encode(trainer, x) if "messages" in x else x for x in inputs]
        data = [datum_of(f) for f in features]
        config = {**trainer.config.loss_kwargs, **(payload.get("loss_kwargs") or {})}
        return ForwardBackwardInput(data=data, loss_fn=trainer.config.backend_loss, loss_fn_config=config)

    def _encode(self, trainer: AdapterTrainer, trajectory: dict[str, Any]) -> dict[str, Any]:
        from twinkle.data_format import Trajectory

        template = self._template(trainer.config)
        feature: dict[str, Any] = template.encode(Trajectory.model_validate(trajectory))
        return feature

    def _template(self, config: TrainConfig) -> Any:
        if not config.template:
            raise InvalidRequest("Trajectories need a template on the server.",
                                 hint="Call set_template('Qwen3_5Template') first, or send encoded InputFeatures.")
        from twinkle.template import get_template

        kwargs = {"model_id": self.pool.backend.info.tokenizer_id, **config.template_kwargs}
        key = json.dumps([config.template, kwargs], sort_keys=True, default=str)
        if key not in self._templates:
            self._templates[key] = get_template(config.template, **kwargs)
        return self._templates[key]

    def _summarise(self, trainer: AdapterTrainer, batch: ForwardBackwardInput, out: ForwardBackwardOutput,
                   *, training: bool) -> dict[str, Any]:
        tokens = float(sum(float(np.sum(d.loss_fn_inputs.get("weights", np.ones(1)))) for d in batch.data))
        loss_sum = float(out.metrics.get("loss:sum", 0.0))
        if training:
            trainer.state.loss_sum += loss_sum
            trainer.state.loss_tokens += tokens
        return {
            "loss": loss_sum / tokens if tokens else loss_sum,
            "metrics": out.metrics,
            "logprobs": [np.asarray(o["logprobs"]).ravel().tolist() for o in out.loss_fn_outputs],
        }
