"""What the megatron backend needs, checked without importing torch or megatron-core eagerly.

`check-config` and `launch` call `megatron_requirements_problem()` for every `backend: megatron` pool, so
a machine without the extra or without a GPU is told so before any worker starts.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install 'twinkle[megatron]'"
NEEDS = f"backend: megatron needs megatron-core ({INSTALL_HINT}) and a CUDA GPU"


def megatron_requirements_problem() -> str | None:
    """None when megatron-core is installed and torch sees a CUDA GPU, else the exact message to show."""
    missing = []
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        missing.append("megatron-core is not installed")
    cuda = cuda_problem()
    if cuda is not None:
        missing.append(cuda)
    if not missing:
        return None
    return f"{NEEDS}; found: {'; '.join(missing)}."


def cuda_problem() -> str | None:
    """None when torch sees a usable CUDA GPU, else what stands in the way (also used for vLLM)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch  # deferred: only a megatron pool's config check pays for it

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (no CUDA)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU"
    return None
