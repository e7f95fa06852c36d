"""torch.distributed collectives for the ranks of a device group: gloo on CPU, NCCL on GPU.

Each rank process joins one process group when its device group starts; `TorchGradientReducer` is the
`GradientReducer` that backends use in `sync_gradients`. Buffers are flattened into one tensor per
all-reduce, because a LoRA adapter is hundreds of small tensors and each collective has a fixed cost.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def join_process_group(*, master_addr: str, master_port: int, rank: int, world_size: int,
                       device_type: str) -> str:
    """Join the device group's process group (the env variables are those torchrun sets, so backends that
    look for them, like megatron, find the group already initialised). Returns the collective backend."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    backend = "nccl" if device_type == "cuda" and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray exposes exactly one GPU to each rank
    store = rendezvous_store(master_addr, master_port, rank=rank, world_size=world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    return backend


def rendezvous_store(master_addr: str, master_port: int, *, rank: int, world_size: int) -> dist.TCPStore:
    """The process group's key-value store. torch's own master listens on every interface; this one listens
    on `master_addr` only (loopback for a one-node group), so the unauthenticated store is not exposed."""
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((master_addr, master_port))
        listener.listen(max(64, world_size))
        listen_fd = listener.detach()  # the store owns the socket from here on
    return dist.TCPStore(master_addr, master_port, world_size, rank == 0, COLLECTIVE_TIMEOUT,
                         master_listen_fd=listen_fd)


class TorchGradientReducer:
    """Implements `twinkle.backends.data_parallel.GradientReducer` on the default process group."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sum_(self, buffers: Sequence[Any]) -> None:
        tensors = [torch.from_numpy(b) if isinstance(b, np.ndarray) else b for b in buffers]
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for tensor in tensors:
            size = tensor.numel()
            tensor.copy_(flat[offset : offset + size].view_as(tensor))
            offset += size
