"""Sampler vs training logprobs through a launched server (transformers backend, torch sampler pool, CPU).

    python bench/logprob_gap.py [--samples 100] [--adapters 4] [--max-tokens 16]

Trains `--adapters` LoRA adapters a few steps each on the tiny model, saves their sampler weights, then sends
`--samples` sample requests at once from as many threads, spread over the adapters, with mixed prompt
lengths and sampling parameters (temperature 0 / 0.7 / 1 / 1.3, top_k, top_p), so the sampler pool serves
them in mixed-adapter batches that requests join mid-generation. Each sampled sequence is then scored by its
adapter's training client (`forward`, loss `cross_entropy`, same weights), and the sampler's per-token
logprobs are compared with the trainer's. Prints the max and mean absolute difference over every sampled
token, and the count of errors (failed requests, or logprobs missing or not finite). Target: max < 1e-4 in
float32, 0 errors.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import launch
from twinkle.tiny_model import ensure_tiny_model

CYCLE = [(7 * i) % 97 + 20 for i in range(40)]
PARAMS = [(1.0, -1, 1.0), (0.7, 20, 1.0), (1.3, -1, 0.9), (0.0, -1, 1.0), (0.5, 50, 0.95)]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def measure(base_url: str, samples: int, adapters: int, max_tokens: int) -> None:
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench-logprob-gap")
    trainers, samplers = [], []
    for k in range(adapters):
        training = service.create_lora_training_client(base_model="tiny-qwen", rank=8, seed=k).result()
        for _ in range(3):
            training.forward_backward([datum(CYCLE[k : k + 24])], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=0.02)).result()
        trainers.append(training)
        samplers.append(training.save_weights_and_get_sampling_client().result())

    prompts = [CYCLE[i % 7 : i % 7 + 1 + i % 13] for i in range(samples)]
    results: list[list[int] | None] = [None] * samples
    logprobs: list[list[float] | None] = [None] * samples
    errors = 0
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal errors
        temperature, top_k, top_p = PARAMS[i % len(PARAMS)]
        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                      seed=i, stop=[])
        try:
            sequence = samplers[i % adapters].sample(types.ModelInput.from_ints(prompts[i]), 1, params
                                                     ).result().sequences[0]
            results[i], logprobs[i] = list(sequence.tokens), sequence.logprobs
        except Exception as error:  # noqa: BLE001 - counted and reported
            with lock:
                errors += 1
            print(f"  sample {i} failed: {error}")

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(samples)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started

    gaps: list[float] = []
    for k in range(adapters):
        mine = [i for i in range(k, samples, adapters) if results[i] is not None]
        if not mine:
            continue
        forward = trainers[k].forward([datum(prompts[i] + (results[i] or [])) for i in mine], "cross_entropy").result()
        for i, output in zip(mine, forward.loss_fn_outputs, strict=True):
            sampled = logprobs[i]
            if sampled is None or len(sampled) != len(results[i] or []) or not all(map(math.isfinite, sampled)):
                errors += 1
                continue
            expected = output["logprobs"].to_numpy()[len(prompts[i]) - 1 :]
            gaps.extend(np.abs(np.asarray(sampled, np.float64) - expected).tolist())
    print(f"logprob gap, sampler vs training forward, {samples} samples over {adapters} adapters "
          f"({len(gaps)} tokens, sampled in {elapsed:.1f} s): max {max(gaps, default=float('nan')):.3g}, "
          f"mean {float(np.mean(gaps)) if gaps else float('nan'):.3g}, errors {errors}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--db", type=int, default=10, help="Redis database the launched server uses (flushed)")
    ns = parser.parse_args()
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = ensure_tiny_model(work / "tiny-qwen")
        server = launch(work, model_dir, db=ns.db, backend="transformers", sampler=True,
                        env={"OMP_NUM_THREADS": threads})
        try:
            measure(server.base_url, ns.samples, ns.adapters, ns.max_tokens)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
