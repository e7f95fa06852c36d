"""The megatron-core (0.16) calls that assume CUDA, adjusted so the backend's tests can run on a CPU.

Megatron-core targets GPUs only. Its local (non-Transformer-Engine) layers build and run on CPU tensors,
but three things on the forward/backward path call CUDA unconditionally:

1. `tensor_parallel.random.CudaRNGStatesTracker` keeps its dropout streams as CUDA RNG states, and
   `DotProductAttention.forward` enters `get_cuda_rng_tracker().fork()` even when dropout is 0.
   Megatron's own inference tracker forks nothing; we use it, since this backend's Megatron dropouts are
   always 0 (Qwen/Llama train without them; LoRA dropout runs in our hooks on torch's RNG).
2. `RotaryEmbedding.get_emb` moves its frequencies to `torch.cuda.current_device()` on first use.
   We compute them on the device they were created on.
3. `utils.GlobalMemoryBuffer.get_tensor` (the attention-score buffer of `DotProductAttention`) allocates
   on `torch.cuda.current_device()`. We allocate on the CPU instead.
4. `transformer.utils.get_default_causal_mask` allocates on "cuda" when no mask is passed. The backend
   always passes its own mask, so nothing is needed here.

Everything else (parallel linear layers with `use_cpu_initialization`, the vocab-parallel cross entropy,
gloo collectives) runs on CPU as shipped. The pipeline schedules do not (`schedules.py` allocates its
token counter on "cuda"), which is one reason this backend calls the model directly for pp_size=1.
"""

from __future__ import annotations

import math
import types

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.utils import GlobalMemoryBuffer
from torch import nn


def use_dropout_free_rng_tracker() -> None:
    """Replace the CUDA RNG tracker by Megatron's inference tracker (valid while Megatron dropouts are 0)."""
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def allocate_buffers_on_cpu() -> None:
    """Make Megatron's global memory buffer (attention scores of the local attention) allocate on the CPU."""
    buffer = parallel_state.get_global_memory_buffer()
    if type(buffer) is GlobalMemoryBuffer:
        buffer.__class__ = _CpuMemoryBuffer
        buffer.buffer.clear()


class _CpuMemoryBuffer(GlobalMemoryBuffer):
    """GlobalMemoryBuffer of megatron-core 0.16 with its tensors on the CPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # type: ignore[no-untyped-def]
        required = math.prod(tensor_shape)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < required:
            current = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, requires_grad=False)
        return current[:required].view(*tensor_shape)


def keep_rotary_on_device(model: nn.Module) -> None:
    """Make the model's rotary embedding compute its frequencies where they are instead of on CUDA."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.get_emb = types.MethodType(_rotary_embedding_in_place, module)  # type: ignore[method-assign]


def _rotary_embedding_in_place(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb of megatron-core 0.16 without the move to torch.cuda.current_device()."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]
