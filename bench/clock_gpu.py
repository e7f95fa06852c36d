"""Fused multi-tenant training passes on a GPU, in process: serial vs fused tokens/s for 1, 4, 16 tenants.

    python bench/clock_gpu.py [--model-dir DIR] [--tenants 1,4,16] [--steps 5] [--dtype bfloat16]

Without --model-dir it builds a random Qwen-family model of hidden 1024, 8 layers (twinkle.tiny_model), so it
runs on a machine with no network. Each tenant has its own rank-16 LoRA on attention, MLP and the output
head and sends steps of forward_backward on 4 x 128 tokens + optim_step. "serial" runs every tenant's
forward_backward alone, one after the other, as a model pool without `clock` does; "fused" runs them as one
`TransformersBackend.run_fused` pass, as a pool with `clock.enabled` does when the tenants' ops are ready
together. Both then run the tenants' optim_steps. It also checks that the fused losses equal the solo ones.

GPU design. On a GPU a step of one tenant (4 x 128 tokens) is far too small to fill the device: every
base-model matmul is latency- and launch-bound, so N tenants served one at a time take ~N times as long as
one. A clock cycle concatenates the tenants' rows (right-padded to the longest) into one batch, so the base
model's matmuls, attention and the LM head run once over N x 512 tokens: the time per cycle grows far less
than N until the device is compute-bound. Per-row LoRA (`twinkle/backends/hf/fused_lora.py`) is the
gathered batched matmul of Punica's BGMV: per LoRA layer the cycle's adapters are stacked (zero-padded to
the largest rank, the LoRA scale folded into B), each row gathers its adapter's A and B, and two `bmm`
kernels add the delta, a fixed number of kernels however many adapters share the batch. The gathered
copies cost rows x rank x hidden per layer (a few MB at 16 tenants on a 4k-hidden model); for much larger
cycles the same interface takes a segment matmul kernel (Punica SGMV / vLLM's LoRA kernels) without changing
anything else. Gradients flow through the stacks into each adapter's own parameters, so one backward of the
summed losses trains every tenant exactly as alone. On CPU, where a step of 4 x 128 tokens is already
compute-bound, fusing saves only the per-op fixed costs (see bench/training.py --multi-tenant).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from twinkle.tiny_model import ensure_tiny_model

SEQ, BATCH, RANK = 128, 4, 16
MID = {"hidden_size": 1024, "num_layers": 8, "intermediate_size": 4096, "num_heads": 16, "num_kv_heads": 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--tenants", default="1,4,16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    ns = parser.parse_args()
    import torch

    from twinkle.backends.transformers_backend import TransformersBackend
    from twinkle.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec, chunks_from_tokens

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ns.model_dir or str(ensure_tiny_model(Path(tmp) / "mid-qwen", **MID))
        counts = [int(n) for n in ns.tenants.split(",")]
        backend = TransformersBackend(model_dir, torch_dtype=ns.dtype, device=ns.device, max_loras=max(counts))
        vocab = backend.info.vocab_size
        for k in range(max(counts)):
            backend.create_adapter(f"t{k}", LoraSpec(rank=RANK, seed=k))
        rows = [[(31 * i + 7 * r) % (vocab - 10) + 6 for i in range(SEQ + 1)] for r in range(2 * BATCH)]
        batches = [ForwardBackwardInput([Datum(chunks_from_tokens(row[:-1]),
                                               {"target_tokens": np.asarray(row[1:]),
                                                "weights": np.ones(SEQ, np.float32)})
                                         for row in rows[(k % 2) * BATCH:(k % 2 + 1) * BATCH]])
                   for k in range(max(counts))]
        errors = 0

        def sync() -> None:
            if ns.device.startswith("cuda"):
                torch.cuda.synchronize()

        def step(count: int, fused: bool) -> float:
            nonlocal errors
            sync()
            started = time.perf_counter()
            if fused:
                outs = backend.run_fused([(f"t{k}", batches[k], True) for k in range(count)])
                errors += sum(isinstance(out, Exception) for out in outs)
            else:
                for k in range(count):
                    backend.forward_backward(f"t{k}", batches[k])
            for k in range(count):
                backend.optim_step(f"t{k}", AdamParams(learning_rate=1e-5))
            sync()
            return time.perf_counter() - started

        # the fused losses are the solo ones (same weights: forward only)
        solo = [backend.forward(f"t{k}", batches[k]).metrics["loss:sum"] for k in range(max(counts))]
        together = backend.run_fused([(f"t{k}", batches[k], False) for k in range(max(counts))])
        drift = max(abs(out.metrics["loss:sum"] - want) / max(1.0, abs(want))
                    for out, want in zip(together, solo, strict=True) if not isinstance(out, Exception))
        print(f"model {model_dir}, {ns.dtype} on {ns.device}; fused vs solo loss, largest relative difference "
              f"{drift:.2e}")
        for count in counts:
            for fused in (False, True):
                step(count, fused)  # warm up this shape
            serial = statistics.median(step(count, False) for _ in range(ns.steps))
            fused_time = statistics.median(step(count, True) for _ in range(ns.steps))
            tokens = count * BATCH * SEQ
            print(f"{count:>3} tenants: serial {tokens / serial:9.0f} tok/s ({serial * 1000:7.1f} ms/cycle), "
                  f"fused {tokens / fused_time:9.0f} tok/s ({fused_time * 1000:7.1f} ms/cycle), "
                  f"fused/serial {serial / fused_time:5.2f}x")
        print(f"errors: {errors}")


if __name__ == "__main__":
    main()
