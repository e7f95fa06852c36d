"""A full-parameter training run on the shared base model: every base weight trained, every LoRA adapter idle.

A backend holds at most one full run, and while it exists no LoRA op runs there (the pool holds the replica
exclusively, and the backend refuses them too): the run trains the very weights the LoRA adapters sit on.

Start: an exact copy of the base model's own weights (never LoRA tensors) goes to host memory, pinned when the
model is on an accelerator, so that the end can put them back bit for bit. The weights then require grad, and
an AdamW optimizer, step counter and random stream of their own live in a `Tenant` named FULL_RUN_NAME, so
`optim_step` is `hf.tenant.adam_step` itself: same clipping, same hyper-parameters, same metrics.

Passes run the base model with every LoRA adapter switched off. Losses that read the reference policy (dpo,
grpo with kl_beta) and `disable_lora` forwards get the original base model: the host copy is swapped in for that
no-grad forward (`original_weights`), which is exact but costs one host-to-device copy of the weights and, on an
accelerator, room for one more copy of them on the device while it runs.

End: the host copy is written back, requires_grad goes off again, and optimizer, gradients and the host copy are
freed, so the LoRA adapters find exactly the model they were trained on.

Checkpoints are standalone HuggingFace model directories (`save_model_directory`): config.json, generation
config, safetensors weights (sharded with model.safetensors.index.json past `max_shard_size`) under the model's
own key names, the base model's tokenizer files and the `twinkle.full_checkpoint` marker; with the optimizer,
also hf.checkpoint's optimizer.pt, trainer_state.json and rng_state.pt, so a resume continues bit-exactly.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from twinkle import full_checkpoint
from twinkle.backends.hf import checkpoint
from twinkle.backends.hf.merge import PROCESSOR_FILE_NAMES
from twinkle.backends.hf.tenant import RngState, Tenant, new_optimizer
from twinkle.errors import InvalidRequest
from twinkle.tokenizer_files import TOKENIZER_FILE_NAMES
from twinkle.types import LoraSpec

FULL_RUN_NAME = "__full__"  # the Tenant name of a full run: no PEFT adapter is ever called that
DEFAULT_MAX_SHARD_SIZE = "2GB"
SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
_LORA_SEGMENTS = frozenset(LoraLayer.adapter_layer_names)  # lora_A, lora_B, lora_embedding_*, lora_magnitude_vector
_WRITTEN_BY_SAVE = frozenset({"config.json", "generation_config.json"})


def is_lora_key(key: str) -> bool:
    """Whether a state-dict key of a PEFT-injected model belongs to a LoRA adapter."""
    return any(segment in _LORA_SEGMENTS for segment in key.split("."))


def clean_key(key: str) -> str:
    """The base model's own name for a key of a PEFT-injected model (PEFT moves wrapped layers to `base_layer`)."""
    return key.replace(".base_layer.", ".")


def base_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base model's own parameters under their clean names, each once (tied weights under their first
    name), in the model's order, so optimizer states line up on every replica and after a reload."""
    return {clean_key(name): param for name, param in model.named_parameters() if not is_lora_key(name)}


class FullRun:
    """The one full-parameter run of a backend; see the module docstring."""

    def __init__(self, run_id: str, tenant: Tenant, weights: dict[str, nn.Parameter], host: list[torch.Tensor],
                 device: torch.device) -> None:
        self.run_id = run_id
        self.tenant = tenant  # optimizer, step counter and random stream, as a LoRA tenant has them
        self.weights = weights
        self._host: list[torch.Tensor] = host  # the original weights, in the order of tenant.params
        self.device = device

    @classmethod
    def start(cls, run_id: str, spec: LoraSpec, model: PreTrainedModel, device: torch.device) -> FullRun:
        weights = base_weights(model)
        params = list(weights.values())
        host = _host_copy(params, device)
        for param in params:
            param.grad = None
            param.requires_grad_(True)
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        tenant = Tenant(run_id, FULL_RUN_NAME, spec, seed, params, new_optimizer(params), RngState.seeded(seed, device))
        return cls(run_id, tenant, weights, host, device)

    @property
    def steps(self) -> int:
        return self.tenant.steps

    @contextmanager
    def original_weights(self) -> Iterator[None]:
        """Run the base model as it was before the run inside this block (no grad: the weights are swapped, not
        copied back); the trained weights return untouched afterwards."""
        params = self.tenant.params
        trained = [param.data for param in params]
        try:
            with torch.no_grad():
                for param, original in zip(params, self._host, strict=True):
                    param.data = original.to(self.device, non_blocking=True)  # the host tensor itself on a CPU model
                yield
        finally:
            for param, weights in zip(params, trained, strict=True):
                param.data = weights

    def end(self) -> None:
        """Put the original weights back bit for bit and free what the run held."""
        params = self.tenant.params
        with torch.no_grad():
            for param, original in zip(params, self._host, strict=True):
                param.grad = None
                param.copy_(original, non_blocking=True)
                param.requires_grad_(False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.tenant.optimizer.state.clear()  # the moments: twice the model's size
        self.tenant.params = []
        self._host = []
        if self.device.type == "cuda":
            # pinned blocks stay cached by the host allocator until emptied; a run's copy is a whole model
            torch.accelerator.empty_host_cache()

    def load_weights(self, model: PreTrainedModel, directory: Path) -> None:
        """Replace the trained weights with those of a full checkpoint directory (`save_model_directory`); on
        InvalidRequest (another model's checkpoint) nothing has changed."""
        check_full_checkpoint(directory)
        files = _weight_files(directory)
        names = {name: file for file in files for name in _names_in(file)}
        known = {clean_key(key) for key in model.state_dict() if not is_lora_key(key)}  # tied names, buffers
        with torch.no_grad():
            if set(self.weights) <= set(names) <= known:
                _check_shapes(names, self.weights)
                for file in files:
                    with safe_open(str(file), framework="pt", device="cpu") as handle:
                        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                            if name in self.weights:
                                self.weights[name].copy_(handle.get_tensor(name))
            else:  # other names: the model's own loader converts them (e.g. fused MoE experts)
                loaded = _load_converted(model, directory, self.weights)
                for name, param in self.weights.items():
                    param.copy_(loaded[name])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.tenant.zero_grad()


def check_full_checkpoint(directory: Path) -> None:
    """Raise InvalidRequest unless `directory` is a full-parameter checkpoint."""
    if full_checkpoint.is_full_checkpoint(directory):
        return
    if (directory / checkpoint.ADAPTER_CONFIG).is_file():
        raise InvalidRequest(
            f"{directory.name} is a LoRA adapter checkpoint, and this model is a full-parameter run.",
            hint="Create a LoRA model (mode='lora') with the checkpoint's LoRA config and load it there.",
        )
    raise InvalidRequest(
        f"{directory.name} is not a full-parameter checkpoint: {full_checkpoint.MARKER} is missing.",
        hint="Pass a path written by save_state or save_weights_for_sampler of a full-parameter run.",
    )


def save_model_directory(run: FullRun, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                         directory: Path, *, base_model: str, include_optimizer: bool,
                         max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write the run's weights as a HuggingFace model directory that AutoModelForCausalLM loads on its own."""
    directory.mkdir(parents=True, exist_ok=True)
    # The model's state dict (buffers and tied names included, so save_pretrained unties and converts names as
    # for any model), minus the LoRA tensors and under the model's own key names.
    state = {clean_key(key): value.detach() for key, value in model.state_dict().items() if not is_lora_key(key)}
    model.save_pretrained(str(directory), state_dict=state, max_shard_size=max_shard_size)
    _copy_tokenizer_files(model, tokenizer, directory)
    if include_optimizer:
        checkpoint.save_training_state(run.tenant, directory)
    full_checkpoint.write_marker(directory, base_model=base_model, steps=run.steps,
                                 include_optimizer=include_optimizer)


def _host_copy(params: list[nn.Parameter], device: torch.device) -> list[torch.Tensor]:
    """Exact copies of `params` in host memory: pinned on a GPU, so the copies go straight by DMA."""
    if device.type != "cuda":
        return [param.detach().to("cpu", copy=True) for param in params]
    host = [torch.empty(param.shape, dtype=param.dtype, pin_memory=True) for param in params]
    for target, param in zip(host, params, strict=True):
        target.copy_(param.detach(), non_blocking=True)
    torch.cuda.synchronize(device)
    return host


def _check_shapes(files_of: dict[str, Path], weights: dict[str, nn.Parameter]) -> None:
    """Raise InvalidRequest, before any weight is written, when a saved weight's shape differs from the model's."""
    wrong = []
    for name, param in weights.items():
        with safe_open(str(files_of[name]), framework="pt", device="cpu") as handle:
            shape = tuple(handle.get_slice(name).get_shape())
        if shape != tuple(param.shape):
            wrong.append(f"{name} {shape} (this model: {tuple(param.shape)})")
    if wrong:
        raise InvalidRequest(
            f"The checkpoint's weights do not fit this model: {len(wrong)} shapes differ, e.g. {wrong[:3]}.",
            hint="Load a checkpoint of the same base model.",
        )


def _load_converted(model: PreTrainedModel, directory: Path,
                    weights: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """The weights through `from_pretrained` of the model's own class on the CPU, which undoes the renaming and
    re-fusing that save_pretrained applied; raises InvalidRequest when they do not fit this model."""
    loaded: Any = type(model).from_pretrained(  # with output_loading_info: (model, info), untyped
        str(directory), dtype=model.dtype, device_map={"": "cpu"}, output_loading_info=True
    )
    loaded_model, info = cast(tuple[PreTrainedModel, dict[str, Any]], loaded)
    problems = {key: sorted(info.get(key) or ()) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        raise InvalidRequest(
            f"The checkpoint's weights do not fit this model: {_describe(problems)}.",
            hint="Load a checkpoint of the same base model.",
        )
    theirs = {name: param.detach() for name, param in base_weights(loaded_model).items()}
    if set(theirs) != set(weights) or any(theirs[name].shape != param.shape for name, param in weights.items()):
        raise InvalidRequest(
            f"The checkpoint's weights do not fit this model ({len(set(theirs) ^ set(weights))} names differ).",
            hint="Load a checkpoint of the same base model.",
        )
    return theirs


def _describe(problems: dict[str, list[str]]) -> str:
    return "; ".join(f"{len(keys)} {kind.replace('_', ' ')} (e.g. {keys[:3]})" for kind, keys in problems.items()
                     if keys)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / SAFE_WEIGHTS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / SAFE_WEIGHTS).is_file():
        return [directory / SAFE_WEIGHTS]
    raise InvalidRequest(f"{directory.name} holds no {SAFE_WEIGHTS} and no {SAFE_WEIGHTS_INDEX}.",
                         hint="Pass a path written by save_state of a full-parameter run.")


def _names_in(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt", device="cpu") as handle:
        return list(handle.keys())


def _copy_tokenizer_files(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """The base model's tokenizer (and processor) files as they are; a tokenizer written by transformers where
    the base model's directory is not known."""
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    if not source.is_dir():
        tokenizer.save_pretrained(str(directory))
        return
    for name in (*TOKENIZER_FILE_NAMES, *PROCESSOR_FILE_NAMES):
        if name not in _WRITTEN_BY_SAVE and (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
