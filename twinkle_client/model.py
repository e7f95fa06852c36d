"""MultiLoraTransformersModel: a LoRA adapter trained on a Twinkle server, with the local model's methods.

    model = MultiLoraTransformersModel(model_id='ms://Qwen/Qwen3.5-4B')
    lora_config = LoraConfig(target_modules='all-linear')
    model.add_adapter_to_model('default', lora_config, gradient_accumulation_steps=2)
    model.set_loss('CrossEntropyLoss')
    model.set_optimizer('Adam', lr=1e-4)
    for batch in dataloader:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()

Each method waits for its result. Its `submit_*` twin returns a TwinkleFuture instead, so calls can be
pipelined; the server runs one adapter's requests in the order they were submitted:

    backward = model.submit_forward_backward(inputs=batch)
    step = model.submit_clip_grad_and_step()
    print(backward.result().loss, step.result().cur_step)

Losses, optimizers, schedulers, templates and processors are chosen by name from the server's
registries (no import paths travel); an unknown name fails with a RequestFailed listing the valid names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, overload

from twinkle_client.client import TwinkleClient, current_client
from twinkle_client.errors import InvalidArgument
from twinkle_client.futures import TwinkleFuture
from twinkle_client.inputs import wire_inputs, wire_value
from twinkle_client.types import (
    ForwardBackwardResult,
    ForwardOnlyResult,
    HubUpload,
    MetricResult,
    StepResult,
    TrainConfig,
    as_twinkle_path,
)

log = logging.getLogger("twinkle_client")
T = TypeVar("T")

_LORA_OPTIONS = {
    "r": "rank",
    "rank": "rank",
    "lora_alpha": "alpha",
    "alpha": "alpha",
    "target_modules": "target_modules",
    "lora_dropout": "dropout",
    "dropout": "dropout",
    "seed": "seed",
    "train_mlp": "train_mlp",
    "train_attn": "train_attn",
    "train_unembed": "train_unembed",
}
_PEFT_SENT = ("r", "lora_alpha", "target_modules", "lora_dropout")
_PEFT_BOOKKEEPING = {
    "peft_type",
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
}


def lora_config_body(config: Any) -> dict[str, Any]:
    """The server's lora_config from a peft.LoraConfig or a dict (peft's or the server's option names)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        options = dict(config)
    elif hasattr(config, "r") and hasattr(config, "lora_alpha"):  # a peft.LoraConfig, without importing peft
        options = {name: getattr(config, name, None) for name in _PEFT_SENT}
        _warn_about_unsent_peft_options(config)
    else:
        raise InvalidArgument(
            f"Cannot use a {type(config).__name__} as a LoRA config. Pass peft.LoraConfig(...) or a dict "
            "such as {'r': 8, 'lora_alpha': 32, 'target_modules': 'all-linear'}."
        )
    body: dict[str, Any] = {}
    for key, value in options.items():
        if key not in _LORA_OPTIONS:
            raise InvalidArgument(
                f"Unknown LoRA option {key!r}. Known options: {', '.join(sorted(_LORA_OPTIONS))}."
            )
        if value is None:
            continue
        if _LORA_OPTIONS[key] == "target_modules" and not isinstance(value, str):
            value = sorted(value)
        body[_LORA_OPTIONS[key]] = value
    return body


def _warn_about_unsent_peft_options(config: Any) -> None:
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return
    try:
        defaults = type(config)()
    except Exception:  # noqa: BLE001 - only used to find non-default options; nothing to warn about then
        return
    changed = [
        field.name
        for field in dataclasses.fields(config)
        if field.name not in _PEFT_SENT
        and field.name not in _PEFT_BOOKKEEPING
        and getattr(config, field.name) != getattr(defaults, field.name)
    ]
    if changed:
        log.warning(
            "The server's LoRA uses r, lora_alpha, target_modules and lora_dropout; these LoraConfig "
            "settings are ignored: %s.",
            ", ".join(changed),
        )


def _registry_name(value: str | type, what: str) -> str:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, type):
        return value.__name__
    raise InvalidArgument(
        f"Name the {what} by its registered name (a string such as 'CrossEntropyLoss'), "
        f"got {type(value).__name__}."
    )


def _train_config(reply: dict[str, Any]) -> TrainConfig:
    return TrainConfig.model_validate(reply["train_config"])


def _save_path(reply: dict[str, Any]) -> str:
    return str(reply.get("twinkle_path") or as_twinkle_path(reply["path"]))


class MultiLoraTransformersModel:
    """One LoRA adapter on a served base model; `model_id` names the base model (`ms://Org/Name`, `Org/Name`,
    the served name, or a local model directory)."""

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None) -> None:
        self.client = client or current_client()
        self.model_id = model_id
        self.base_model = self.client.served_model(model_id, "train").model_name
        self.adapter_name: str | None = None
        self._run_id: str | None = None
        self._adapter: TwinkleFuture[str] | None = None

    def __repr__(self) -> str:
        return (
            f"MultiLoraTransformersModel({self.base_model!r}, adapter={self.adapter_name!r}, "
            f"run={self._run_id!r})"
        )

    @property
    def training_run_id(self) -> str:
        """The server's id of this adapter: its training run (see TwinkleClient.list_checkpoints)."""
        if self._run_id is None and self._adapter is not None:
            self._adapter.result()
        if self._run_id is None:
            raise InvalidArgument(
                "This model has no adapter yet. Call add_adapter_to_model(name, LoraConfig(...)) "
                "first; it creates the adapter on the server."
            )
        return self._run_id

    # The adapter.

    def add_adapter_to_model(
        self, adapter_name: str, config: Any = None, gradient_accumulation_steps: int = 1, *,
        training_mode: Literal["lora", "full"] = "lora",
    ) -> str:
        """Create the adapter on the server and return its training run id.

        `config` is a peft.LoraConfig (r, lora_alpha, target_modules, lora_dropout are used) or a dict;
        with `gradient_accumulation_steps=N` only every N-th clip_grad_and_step updates the weights.
        `training_mode="full"` trains all the base model's weights instead of an adapter (no `config`), where the
        server allows it: the run holds its pool exclusively while it lives, and other runs wait.
        """
        return self.submit_add_adapter_to_model(
            adapter_name, config, gradient_accumulation_steps, training_mode=training_mode).result()

    def submit_add_adapter_to_model(
        self, adapter_name: str, config: Any = None, gradient_accumulation_steps: int = 1, *,
        training_mode: Literal["lora", "full"] = "lora",
    ) -> TwinkleFuture[str]:
        if self._adapter is not None:
            raise InvalidArgument(
                f"This model already has adapter {self.adapter_name!r}; create another "
                "MultiLoraTransformersModel to train a second adapter."
            )
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise InvalidArgument(
                f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}."
            )
        if training_mode not in ("lora", "full"):
            raise InvalidArgument(f"training_mode must be 'lora' or 'full', got {training_mode!r}.")
        if training_mode == "full" and config is not None:
            raise InvalidArgument("A full-parameter run trains every weight: it takes no LoRA config.")
        body = {
            "session_id": self.client.session_id,
            "base_model": self.base_model,
            "lora_config": lora_config_body(config),
            "user_metadata": {"adapter_name": adapter_name},
            "training_mode": training_mode,
        }
        self.adapter_name = adapter_name

        def create() -> str:
            run_id = self.client.call("/create_model", body, lambda reply: str(reply["model_id"]))
            self._run_id = run_id
            self.client.call(
                "/twinkle/configure",
                {"model_id": run_id, "gradient_accumulation_steps": gradient_accumulation_steps},
                _train_config,
            )
            return run_id

        self._adapter = self.client.run_in_background(create, "add_adapter_to_model")
        return self._adapter

    def unload(self) -> None:
        """Free the adapter's slot on the server now (its checkpoints stay)."""
        self.submit_unload().result()

    def submit_unload(self) -> TwinkleFuture[None]:
        return self.client.submit("/unload_model", {"model_id": self.training_run_id}, lambda reply: None)

    # Training configuration, kept on the server per adapter.

    def set_template(self, template_name: str | type, **init_args: Any) -> TrainConfig:
        """The template the server uses to encode Trajectory inputs (e.g. 'Qwen3_5Template')."""
        return self.submit_set_template(template_name, **init_args).result()

    def submit_set_template(self, template_name: str | type, **init_args: Any) -> TwinkleFuture[TrainConfig]:
        return self._configure(
            "set_template", template=_registry_name(template_name, "template"), template_kwargs=init_args
        )

    def set_processor(self, processor_name: str | type, **init_args: Any) -> TrainConfig:
        """How inputs become a padded batch, e.g. set_processor('InputProcessor', padding_side='right')."""
        return self.submit_set_processor(processor_name, **init_args).result()

    def submit_set_processor(
        self, processor_name: str | type, **init_args: Any
    ) -> TwinkleFuture[TrainConfig]:
        return self._configure(
            "set_processor", processor=_registry_name(processor_name, "processor"), processor_kwargs=init_args
        )

    def set_loss(self, loss_name: str | type, **loss_kwargs: Any) -> TrainConfig:
        """The loss: 'CrossEntropyLoss', 'DPOLoss', 'GRPOLoss' or a Tinker loss name."""
        return self.submit_set_loss(loss_name, **loss_kwargs).result()

    def submit_set_loss(self, loss_name: str | type, **loss_kwargs: Any) -> TwinkleFuture[TrainConfig]:
        return self._configure("set_loss", loss=_registry_name(loss_name, "loss"), loss_kwargs=loss_kwargs)

    def set_optimizer(self, optimizer_name: str | type, **optimizer_kwargs: Any) -> TrainConfig:
        """The optimizer: 'Adam', 'AdamW' or 'default' (the backend's own); kwargs lr, betas, eps, ..."""
        return self.submit_set_optimizer(optimizer_name, **optimizer_kwargs).result()

    def submit_set_optimizer(
        self, optimizer_name: str | type, **optimizer_kwargs: Any
    ) -> TwinkleFuture[TrainConfig]:
        return self._configure(
            "set_optimizer",
            optimizer=_registry_name(optimizer_name, "optimizer"),
            optimizer_kwargs=optimizer_kwargs,
        )

    def set_lr_scheduler(self, scheduler_name: str | type, **scheduler_kwargs: Any) -> TrainConfig:
        """The learning-rate schedule: 'LinearLR', 'CosineAnnealingLR', 'ConstantLR', 'CosineWarmupLR'
        or 'default'."""
        return self.submit_set_lr_scheduler(scheduler_name, **scheduler_kwargs).result()

    def submit_set_lr_scheduler(
        self, scheduler_name: str | type, **scheduler_kwargs: Any
    ) -> TwinkleFuture[TrainConfig]:
        return self._configure(
            "set_lr_scheduler",
            lr_scheduler=_registry_name(scheduler_name, "lr scheduler"),
            lr_scheduler_kwargs=scheduler_kwargs,
        )

    def get_train_configs(self) -> TrainConfig:
        """The adapter's whole training configuration as the server holds it."""
        return self.submit_get_train_configs().result()

    def submit_get_train_configs(self) -> TwinkleFuture[TrainConfig]:
        return self._submit("/twinkle/get_train_configs", {}, _train_config)

    # The training loop.

    def forward_backward(self, inputs: Any, **loss_kwargs: Any) -> ForwardBackwardResult:
        """Accumulate gradients of the loss on `inputs` (InputFeature dicts or Trajectories).

        `loss_kwargs` go to the loss (e.g. ref_outputs for DPOLoss); per-input values such as advantages or
        old_logps belong in the inputs themselves.
        """
        return self.submit_forward_backward(inputs, **loss_kwargs).result()

    def submit_forward_backward(
        self, inputs: Any, **loss_kwargs: Any
    ) -> TwinkleFuture[ForwardBackwardResult]:
        body = {"inputs": wire_inputs(inputs), "loss_kwargs": wire_value(loss_kwargs)}
        return self._submit("/twinkle/forward_backward", body, ForwardBackwardResult.model_validate)

    def forward_only(self, inputs: Any, disable_lora: bool = False) -> ForwardOnlyResult:
        """Loss and target-token logprobs without gradients; `disable_lora` uses the bare base model
        (the reference model of DPO)."""
        return self.submit_forward_only(inputs, disable_lora).result()

    def submit_forward_only(
        self, inputs: Any, disable_lora: bool = False
    ) -> TwinkleFuture[ForwardOnlyResult]:
        body = {"inputs": wire_inputs(inputs), "disable_lora": disable_lora}
        return self._submit("/twinkle/forward_only", body, ForwardOnlyResult.model_validate)

    def clip_grad_and_step(self, max_grad_norm: float | None = None) -> StepResult:
        """Clip gradients, step the optimizer and the scheduler, zero the gradients (every N-th call with
        gradient accumulation; the other calls return stepped=False)."""
        return self.submit_clip_grad_and_step(max_grad_norm).result()

    def submit_clip_grad_and_step(self, max_grad_norm: float | None = None) -> TwinkleFuture[StepResult]:
        body = {} if max_grad_norm is None else {"max_grad_norm": max_grad_norm}
        return self._submit("/twinkle/clip_grad_and_step", body, StepResult.model_validate)

    def calculate_metric(self, is_training: bool = True) -> MetricResult:
        """Means since the previous call (loss, grad_norm, lr, cur_step, tokens, ...) in `.result`."""
        return self.submit_calculate_metric(is_training).result()

    def submit_calculate_metric(self, is_training: bool = True) -> TwinkleFuture[MetricResult]:
        return self._submit(
            "/twinkle/calculate_metric", {"is_training": is_training}, MetricResult.model_validate
        )

    # Checkpoints.

    def save(
        self,
        name: str,
        save_optimizer: bool = True,
        consumed_train_samples: int = 0,
        is_sampler: bool = False,
    ) -> str:
        """Save the adapter (and the optimizer state) as checkpoint `name`; returns its `twinkle://` path.

        `consumed_train_samples` (from dataloader.get_state()) is stored so that resuming skips the data
        already trained on; `is_sampler=True` saves weights only, for sampling.
        """
        return self.submit_save(name, save_optimizer, consumed_train_samples, is_sampler).result()

    def submit_save(
        self,
        name: str,
        save_optimizer: bool = True,
        consumed_train_samples: int = 0,
        is_sampler: bool = False,
    ) -> TwinkleFuture[str]:
        body = {
            "name": name,
            "save_optimizer": save_optimizer and not is_sampler,
            "consumed_train_samples": int(consumed_train_samples),
            "kind": "sampler_weights" if is_sampler else "weights",
        }
        return self._submit("/twinkle/save", body, _save_path)

    def resume_from_checkpoint(self, path: str, resume_only_model: bool = False) -> dict[str, Any]:
        """Load a checkpoint's weights, optimizer, scheduler and progress; returns the progress
        (cur_step, consumed_train_samples, gradient_accumulation_steps)."""
        return self.submit_resume_from_checkpoint(path, resume_only_model).result()

    def submit_resume_from_checkpoint(
        self, path: str, resume_only_model: bool = False
    ) -> TwinkleFuture[dict[str, Any]]:
        body = {"path": path, "resume_only_model": resume_only_model}
        return self._submit("/twinkle/resume_from_checkpoint", body, lambda reply: dict(reply["progress"]))

    @overload
    def upload_to_hub(
        self,
        checkpoint_dir: str,
        hub_model_id: str,
        hub_token: str | None = None,
        async_upload: Literal[False] = False,
        private: bool = True,
    ) -> HubUpload: ...

    @overload
    def upload_to_hub(
        self,
        checkpoint_dir: str,
        hub_model_id: str,
        hub_token: str | None = None,
        *,
        async_upload: Literal[True],
        private: bool = True,
    ) -> TwinkleFuture[HubUpload]: ...

    def upload_to_hub(
        self,
        checkpoint_dir: str,
        hub_model_id: str,
        hub_token: str | None = None,
        async_upload: bool = False,
        private: bool = True,
    ) -> HubUpload | TwinkleFuture[HubUpload]:
        """Upload a checkpoint (its `twinkle://` path) to the model hub as `hub_model_id`.

        `async_upload=True` returns the future at once instead of waiting for the upload.
        """
        future = self.submit_upload_to_hub(checkpoint_dir, hub_model_id, hub_token, private)
        return future if async_upload else future.result()

    def submit_upload_to_hub(
        self, checkpoint_dir: str, hub_model_id: str, hub_token: str | None = None, private: bool = True
    ) -> TwinkleFuture[HubUpload]:
        body: dict[str, Any] = {
            "checkpoint_dir": checkpoint_dir,
            "hub_model_id": hub_model_id,
            "private": private,
        }
        if hub_token:
            body["hub_token"] = hub_token
        return self._submit("/twinkle/upload_to_hub", body, HubUpload.model_validate)

    # Plumbing.

    def _configure(self, label: str, **fields: Any) -> TwinkleFuture[TrainConfig]:
        body = {key: wire_value(value) for key, value in fields.items()}
        return self.client.submit(
            "/twinkle/configure", {"model_id": self.training_run_id, **body}, _train_config, label=label
        )

    def _submit(
        self, path: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], T]
    ) -> TwinkleFuture[T]:
        return self.client.submit(path, {"model_id": self.training_run_id, **body}, parse)
