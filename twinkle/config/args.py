"""The `args` of each application kind: the central server, model pools, sampler pools, processors."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator, with_config
from typing_extensions import TypedDict

from twinkle.config.base import StrictModel, config_problem
from twinkle.config.clock import ClockConfig, SchedulingConfig
from twinkle.config.devices import DeviceGroup, DeviceMesh
from twinkle.config.export import ExportConfig
from twinkle.config.full_finetune import FullFinetuneConfig
from twinkle.config.limits import AdapterConfig, QueueConfig
from twinkle.config.parallelism import parallelism_problems

Backend = Literal["transformers", "megatron", "mock"]
TorchDtype = Literal["auto", "bfloat16", "float32", "float16"]
ModelSamplerType = Literal["torch", "mock"]
SamplerType = Literal["vllm", "torch", "mock"]

_HUB_SCHEMES = ("ms://", "hf://")
_ACCELERATORS = ("cuda", "npu")


def served_name_for(model_id: str, served_model_name: str | None) -> str:
    """The base-model name clients use: the explicit one, else the model id without its hub scheme."""
    if served_model_name:
        return served_model_name
    for scheme in _HUB_SCHEMES:
        if model_id.startswith(scheme):
            return model_id[len(scheme) :]
    return model_id


def _mesh_on_group_devices(group: DeviceGroup, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh with its device type filled in from the group; a conflicting type is an error."""
    if mesh.device_type is None:
        # A copy, because a mesh instance passed in by the caller may be shared between applications.
        return mesh.model_copy(update={"device_type": group.device_type})
    if mesh.device_type != group.device_type:
        raise config_problem(
            f"device type {mesh.device_type!r} differs from device_group.device_type {group.device_type!r}",
            subpath="device_mesh.device_type",
            hint="use the same device type in both, or leave device_mesh.device_type out",
        )
    return mesh


class ServerSettings(StrictModel):
    """Limits and housekeeping of the central API server."""

    per_token_model_limit: int = Field(default=0, ge=0)
    """Models (LoRA training clients) one API key may hold at once, server-wide (0 = unlimited)."""
    expiration_timeout: int = Field(default=86400, gt=0)
    """Seconds after which idle sessions and their records expire."""
    cleanup_interval: int = Field(default=60, gt=0)
    """No effect (check-config says so): sessions and futures expire by Redis time-to-live, adapters are checked
    every second."""
    metrics_update_interval: int = Field(default=15, gt=0)
    """Seconds between reads of the resource gauges (active sessions, models, futures, queue depth)."""


class ServerArgs(StrictModel):
    """Arguments of the `server` application (the central API)."""

    server_config: ServerSettings = Field(default_factory=ServerSettings)
    """Limits and housekeeping intervals."""
    supported_models: list[str] = Field(default_factory=list)
    """Base models advertised by get_server_capabilities (served names, e.g. `Qwen/Qwen3.5-4B`)."""


class ModelArgs(StrictModel):
    """Arguments of a `model` application: a pool that trains LoRA adapters on one base model."""

    backend: Backend = "transformers"
    """`transformers` (HF Transformers + PEFT), `megatron` (Megatron-LM, GPU) or `mock` (numpy, CPU)."""
    model_id: str = Field(min_length=1)
    """The base model: a hub id (`ms://Qwen/Qwen3.5-4B`, `hf://...`) or a local directory."""
    max_length: int | None = Field(default=None, gt=0)
    """Longest sequence, in tokens, the pool accepts; None uses the model's own limit."""
    nproc_per_node: int = Field(default=1, ge=1)
    """Worker processes per node (normally one per GPU)."""
    device_group: DeviceGroup = Field(default_factory=DeviceGroup)
    """Devices the pool occupies."""
    device_mesh: DeviceMesh = Field(default_factory=DeviceMesh)
    """Parallel layout over the device group."""
    queue_config: QueueConfig = Field(default_factory=QueueConfig)
    """Rate limits and timeouts of the pool's queue."""
    adapter_config: AdapterConfig = Field(default_factory=AdapterConfig)
    """LoRA slots and adapter lifetimes."""
    clock: ClockConfig = Field(default_factory=ClockConfig)
    """Fused multi-tenant forward/backward passes ("clock cycles"); off by default."""
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    """Which tenant's op runs next: weighted fair share (default) or arrival order."""
    torch_dtype: TorchDtype = "auto"
    """Dtype of the base weights; `auto` uses the checkpoint's."""
    sampler_type: ModelSamplerType | None = None
    """How the model pool samples with its own weights when no sampler pool serves the model; None
    uses the backend's default."""
    served_model_name: str | None = Field(default=None, min_length=1)
    """Name clients use for this base model; None uses model_id without its `ms://` or `hf://` scheme."""
    export: ExportConfig = Field(default_factory=ExportConfig)
    """Merged exports of this pool's checkpoints (`export_merged`): dtype, shard size, tolerances."""
    full_finetune: FullFinetuneConfig = Field(default_factory=FullFinetuneConfig)
    """Full-parameter runs beside the LoRA adapters: one at a time, holding the pool exclusively."""

    @property
    def served_name(self) -> str:
        """The base-model name clients use."""
        return served_name_for(self.model_id, self.served_model_name)

    @model_validator(mode="after")
    def _mesh_fits_group(self) -> ModelArgs:
        self.device_mesh = _mesh_on_group_devices(self.device_group, self.device_mesh)
        mesh, group = self.device_mesh, self.device_group
        if group.device_type in _ACCELERATORS and mesh.world_size != group.ranks:
            raise config_problem(
                f"dp_size x tp_size x pp_size x cp_size = {mesh.world_size}, "
                f"but device_group.ranks is {group.ranks}",
                subpath="device_mesh",
                hint="the training mesh must cover exactly the devices of its group",
            )
        if self.full_finetune.enabled and self.backend == "megatron":
            raise config_problem(
                "full-parameter training is not available on the megatron backend yet",
                subpath="full_finetune.enabled",
                hint="use the transformers backend for full runs (docs/full_finetune.md), or set enabled: false",
            )
        refused = parallelism_problems(self.backend, mesh)
        if refused:
            raise config_problem(
                "; ".join(refused),
                subpath="device_mesh",
                hint="set these sizes to 1 (dp_size adds ranks), or choose a backend that supports them",
            )
        return self


@with_config(ConfigDict(extra="allow", use_attribute_docstrings=True))
class EngineArgs(TypedDict, total=False):
    """vLLM engine arguments, passed through unchanged; the ones below are type-checked."""

    max_model_len: Annotated[int, Field(gt=0)]
    """Longest sequence (prompt + completion) in tokens."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)]
    """Fraction of GPU memory vLLM may take, in (0, 1]."""
    enable_lora: bool
    """Serve LoRA adapters; needed to sample from trained weights."""
    logprobs_mode: str
    """Which logprobs vLLM returns, e.g. `processed_logprobs` or `raw_logprobs`."""
    max_loras: Annotated[int, Field(ge=1)]
    """LoRA adapters vLLM keeps on the GPU at once."""


class SamplerArgs(StrictModel):
    """Arguments of a `sampler` application: a pool that generates text with LoRA adapters."""

    model_id: str = Field(min_length=1)
    """The base model: a hub id (`ms://Qwen/Qwen3.5-4B`, `hf://...`) or a local directory."""
    sampler_type: SamplerType = "torch"
    """`vllm` (GPU, fast), `torch` (HF generate, any device) or `mock` (deterministic, for tests)."""
    engine_args: EngineArgs = Field(default_factory=lambda: EngineArgs())
    """vLLM engine arguments (free-form; the known ones are type-checked)."""
    nproc_per_node: int = Field(default=1, ge=1)
    """Worker processes per node (normally one per GPU)."""
    device_group: DeviceGroup = Field(default_factory=DeviceGroup)
    """Devices the pool occupies."""
    device_mesh: DeviceMesh = Field(default_factory=DeviceMesh)
    """Parallel layout over the device group."""
    queue_config: QueueConfig = Field(default_factory=QueueConfig)
    """Rate limits and timeouts of the pool's queue."""
    adapter_config: AdapterConfig = Field(default_factory=AdapterConfig)
    """LoRA slots and adapter lifetimes."""
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    """Which tenant's sample request joins the generation next: weighted fair share (default) or arrival order."""
    served_model_name: str | None = Field(default=None, min_length=1)
    """Name clients use for this base model; None uses model_id without its `ms://` or `hf://` scheme."""

    @property
    def served_name(self) -> str:
        """The base-model name clients use."""
        return served_name_for(self.model_id, self.served_model_name)

    @model_validator(mode="after")
    def _mesh_matches_group(self) -> SamplerArgs:
        self.device_mesh = _mesh_on_group_devices(self.device_group, self.device_mesh)
        return self


class ProcessorArgs(StrictModel):
    """Arguments of the `processor` application: a CPU pool that tokenizes and applies chat templates."""

    ncpu_proc_per_node: int = Field(default=1, ge=1)
    """Processes per node."""
    device_group: DeviceGroup = Field(default_factory=lambda: DeviceGroup(device_type="cpu"))
    """Devices the pool occupies (CPU by default)."""
    device_mesh: DeviceMesh = Field(default_factory=DeviceMesh)
    """Parallel layout over the device group."""
    queue_config: QueueConfig = Field(default_factory=QueueConfig)
    """Rate limits and timeouts of the pool's queue."""

    @model_validator(mode="after")
    def _mesh_matches_group(self) -> ProcessorArgs:
        self.device_mesh = _mesh_on_group_devices(self.device_group, self.device_mesh)
        return self
