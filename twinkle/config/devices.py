"""Which devices a worker pool occupies and how its ranks are split into parallel groups."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from twinkle.config.base import StrictModel, config_problem


def _normalise_device_type(value: Any) -> Any:
    # The product docs write both `CPU` and `cuda`, so the spelling's case never mattered.
    if not isinstance(value, str):
        return value
    if value.lower() == "gpu":
        raise config_problem(
            "'gpu' is not a device type", hint="write 'cuda' for NVIDIA GPUs, 'npu' for Ascend"
        )
    return value.lower()


DeviceType = Annotated[Literal["cuda", "cpu", "npu"], BeforeValidator(_normalise_device_type)]


class DeviceGroup(StrictModel):
    """The logical group of devices a pool runs on; one Ray placement-group bundle per rank."""

    name: str = "default"
    """Label of the group, shown in logs and Ray placement groups."""
    ranks: int = Field(default=1, ge=0)
    """Number of devices (GPUs for cuda/npu) the pool uses; for CPU pools, the CPU index."""
    device_type: DeviceType = "cuda"
    """`cuda`, `npu` or `cpu` (`CPU` is accepted and normalised to `cpu`)."""


class DeviceMesh(StrictModel):
    """How the group's ranks are split into data, tensor, pipeline, expert and context parallel groups."""

    device_type: DeviceType | None = None
    """Device type of the mesh; None takes the device_group's."""
    dp_size: int = Field(default=1, ge=1)
    """Data-parallel size."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel size."""
    pp_size: int = Field(default=1, ge=1)
    """Pipeline-parallel size."""
    ep_size: int = Field(default=1, ge=1)
    """Expert-parallel size, for mixture-of-experts models (carved out of the data-parallel ranks)."""
    cp_size: int = Field(default=1, ge=1)
    """Context-parallel size, for long sequences."""

    @property
    def world_size(self) -> int:
        """Ranks the mesh spans; expert parallelism reuses data-parallel ranks, so it does not count."""
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size
