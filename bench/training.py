"""Transformers backend through the server vs in process, on the tiny model (CPU).

    python bench/training.py [--steps 20]

(a) Server overhead: one training step (batch 8 x 128 tokens, LoRA rank 16 on attention, MLP and the
    output head as the SDK's defaults ask, AdamW) through a launched server and the Tinker SDK, vs the same
    step in-process with plain transformers + PEFT. Target ratio <= 1.15. Two model sizes: the test suite's
    tiny model (hidden 64, 2 layers), where a step is ~20 ms of compute and the server's fixed ~6 ms per
    step (HTTP, Redis, Celery, both ways) cannot fit in 15%, and a small one (hidden 256, 4 layers) whose
    step costs what the server is for.
(b) Memory: RSS of the model pool with 1, 8 and 32 adapters (each trained one step so its Adam moments
    exist); growth per adapter after the first (which also pays one-time costs) vs the adapter's own size
    (weights + gradients + two Adam moments).
(c) Sampler: tokens/s for 16 concurrent requests over 4 adapters through the sampler pool, vs one
    in-process batched generation of the same requests. Target >= 0.8x. Requests join the running
    generation as they arrive; with 32 tokens each, the ~40-90 ms over which 16 SDK threads' requests reach
    the pool on 2 shared cores is a third of the in-process run, so 128 tokens is measured too.
(d) Multi-tenant clock cycles (`--multi-tenant`, only this part runs): 1, 4 and 16 tenants, each its own
    Tinker SDK client and adapter, each sending steps of forward_backward (4 x 128 tokens) + optim_step to
    one pool on the small model (hidden 256, 4 layers), through a server with `clock.enabled` (fused
    multi-tenant passes) and one without (one op at a time), in the same run. Prints aggregate trained
    tokens/s, per-tenant step p50/p99 and the errors. Target: fused >= 2x serial at 16 tenants on CPU.

        python bench/training.py --multi-tenant [--steps 4] [--tenants 1,4,16]
(e) Full-parameter runs (`--full`, only this part runs): one full step (batch 8 x 128, AdamW over every weight)
    through the server and the Tinker SDK (`user_metadata={"training_mode": "full"}`) vs the same step in process
    with plain transformers + torch.optim.AdamW, on the tiny and the small model. Target ratio <= 1.15. Then the
    full checkpoint's save and load times and size, and how long a LoRA tenant's forward_backward, submitted
    while the full run holds the pool, waits while the full run trains 3 more steps and until it is unloaded.

        python bench/training.py --full [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from raw_client import run_concurrently

from tests.harness import launch
from twinkle.tiny_model import ensure_tiny_model

SEQ, BATCH, RANK = 128, 8, 16
# The Tinker SDK's create_lora_training_client trains attention, MLP and the output head by default.
SDK_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
SIZES = {"tiny": {}, "small": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 1024, "num_heads": 8,
                             "num_kv_heads": 4}}


def token_rows(vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * row) % (vocab - 10) + 6 for i in range(SEQ + 1)] for row in range(BATCH)]


def in_process_step_ms(model_dir: Path, steps: int, batch: int = BATCH) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=32, target_modules=SDK_DEFAULT_TARGETS))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    some = token_rows(model.config.vocab_size)
    rows = torch.tensor([some[i % len(some)] for i in range(batch)])
    return timed_steps_ms(model, optimizer, rows, steps)


def timed_steps_ms(model: Any, optimizer: Any, rows: Any, steps: int) -> float:
    """Median ms of an in-process step (forward, summed cross-entropy, backward, AdamW) after 3 warm-ups."""
    import torch

    inputs, labels = rows[:, :-1], rows[:, 1:]
    times = []
    for i in range(steps + 3):
        started = time.perf_counter()
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 reduction="sum")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= 3:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def server_step_ms(base_url: str, vocab: int, steps: int) -> float:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench-training")
    tc = service.create_lora_training_client(base_model="tiny-qwen", rank=RANK).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * SEQ}) for r in token_rows(vocab)]
    times = []
    for i in range(steps + 3):
        started = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        if i >= 3:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def in_process_full_step_ms(model_dir: Path, steps: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    rows = torch.tensor(token_rows(model.config.vocab_size))
    return timed_steps_ms(model, optimizer, rows, steps)


def full_rows(work: Path, threads: str, steps: int) -> None:
    import tinker
    from tinker import types

    for size in ("tiny", "small"):
        model_dir = ensure_tiny_model(work / size / "tiny-qwen", **SIZES[size])
        local = in_process_full_step_ms(model_dir, steps)
        server = launch(work / size, model_dir, db=10, backend="transformers", env={"OMP_NUM_THREADS": threads},
                        model_args={"full_finetune": {"enabled": True}})
        errors = 0
        try:
            service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench-full")
            lora = service.create_lora_training_client(base_model="tiny-qwen", rank=RANK).result()
            full = service.create_lora_training_client(base_model="tiny-qwen",
                                                       user_metadata={"training_mode": "full"}).result()
            data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                                loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * SEQ})
                    for r in token_rows(512)]
            times, losses = [], []
            for i in range(steps + 3):
                started = time.perf_counter()
                fb = full.forward_backward(data, "cross_entropy")
                opt = full.optim_step(types.AdamParams(learning_rate=1e-5))
                losses.append(fb.result().metrics["loss:sum"])
                opt.result()
                if i >= 3:
                    times.append((time.perf_counter() - started) * 1000)
            remote = statistics.median(times)
            print(f"(e) full-parameter step, {size} model, batch {BATCH}x{SEQ}: server {remote:.1f} ms vs in-process "
                  f"{local:.1f} ms = {remote / local:.3f}x  (loss {losses[0]:.1f} -> {losses[-1]:.1f}, "
                  f"torch threads: {threads})")
            began = time.perf_counter()
            saved = full.save_state("bench").result().path
            save_s = time.perf_counter() - began
            from twinkle.auth import tenant_id
            from twinkle.checkpoints import CheckpointStore, parse_checkpoint_path

            directory = CheckpointStore(server.config["storage"]["checkpoint_dir"]).existing(
                tenant_id("tml-bench-full"), parse_checkpoint_path(saved))
            size_mb = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / 2**20
            submitted = time.perf_counter()
            waiting = lora.forward_backward(data[:1], "cross_entropy")
            for _ in range(3):
                full.forward_backward(data, "cross_entropy").result()
                full.optim_step(types.AdamParams(learning_rate=1e-5)).result()
            unload_at = time.perf_counter()
            # the Tinker SDK has no unload call: the REST route, as the Twinkle client sends it
            import httpx

            httpx.post(f"{server.api}/unload_model", json={"model_id": full.model_id},
                       headers={"X-API-Key": "tml-bench-full"}, timeout=60).raise_for_status()
            waiting.result()
            done = time.perf_counter()
            began = time.perf_counter()
            service.create_training_client_from_state_with_optimizer(saved).result()
            load_s = time.perf_counter() - began
            print(f"(e) full checkpoint, {size} model: save {save_s:.2f} s, load {load_s:.2f} s (create-via-load, "
                  f"with optimizer), {size_mb:.1f} MB; a LoRA tenant's forward_backward waited "
                  f"{unload_at - submitted:.2f} s while the full run trained 3 steps, and was answered "
                  f"{(done - unload_at) * 1000:.0f} ms after the full run's unload was asked")
        except Exception as error:  # noqa: BLE001 - a failed run is counted, never a figure
            errors += 1
            print(f"(e) {size}: FAILED: {type(error).__name__}: {error}")
        finally:
            server.stop()
        print(f"(e) {size}: errors {errors}")


def worker_rss_mb(server: Any, queue: str = "model.models-tiny.0") -> float:
    return float(psutil.Process(server.worker_pid(queue)).memory_info().rss / 2**20)


def adapter_bytes(model_dir: Path) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)),
                           LoraConfig(r=RANK, target_modules=SDK_DEFAULT_TARGETS))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable * 4 * 4  # weights, gradients, two Adam moments, float32


def memory_rows(server: Any, model_dir: Path) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench-memory")
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(10, 42))),
                        loss_fn_inputs={"target_tokens": list(range(11, 43)), "weights": [1.0] * 32})
    base = worker_rss_mb(server)
    created = 0
    print(f"model pool RSS before adapters: {base:.1f} MB; one adapter's own size "
          f"(weights+grads+2 Adam moments): {adapter_bytes(model_dir) / 2**20:.3f} MB")
    first = base
    for target in (1, 8, 32):
        while created < target:
            tc = service.create_lora_training_client(base_model="tiny-qwen", rank=RANK).result()
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams()).result()
            created += 1
        rss = worker_rss_mb(server)
        if target == 1:
            first = rss
            print(f"   1 adapter:  RSS {rss:7.1f} MB, +{rss - base:.3f} MB (once: PEFT wrapping, autograd buffers)")
        else:
            print(f"  {target:>2} adapters: RSS {rss:7.1f} MB, +{(rss - first) / (target - 1):.3f} MB per further "
                  "adapter")


def sampler_rows(server: Any, model_dir: Path, n_requests: int = 16, n_adapters: int = 4, max_tokens: int = 32
                 ) -> None:
    import tinker
    from tinker import types

    from twinkle.samplers.torch_sampler import TorchSampler
    from twinkle.types import SampleRequest, SamplingParams, chunks_from_tokens

    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench-sampler")
    paths, clients = [], []
    for k in range(n_adapters):
        tc = service.create_lora_training_client(base_model="tiny-qwen", rank=RANK, seed=k).result()
        paths.append(tc.save_weights_for_sampler(f"bench-{k}").result().path)
        clients.append(service.create_sampling_client(model_path=paths[-1]).result())
    prompt = list(range(20, 36))
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, stop=[])
    for c in clients:  # warm the LRU
        c.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    tokens = [0] * n_requests

    def one(i: int) -> None:
        out = clients[i % n_adapters].sample(types.ModelInput.from_ints(prompt), 1, params).result()
        tokens[i] = len(out.sequences[0].tokens)

    def burst() -> float:
        started = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n_requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(tokens) / (time.perf_counter() - started)

    burst()  # warm up the mixed-adapter batch path, as the in-process side is warmed up below
    served = statistics.median(burst() for _ in range(3))

    from twinkle.auth import tenant_id
    from twinkle.checkpoints import CheckpointStore, parse_checkpoint_path

    store = CheckpointStore(server.config["storage"]["checkpoint_dir"])
    dirs = [str(store.existing(tenant_id("tml-bench-sampler"), parse_checkpoint_path(p))) for p in paths]
    sampler = TorchSampler(str(model_dir), max_loras=n_adapters, torch_dtype="float32")
    requests = [SampleRequest(prompt=chunks_from_tokens(prompt), adapter_path=dirs[i % n_adapters],
                              params=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, stop_at_eos=False))
                for i in range(n_requests)]
    sampler.sample(requests)

    def batched() -> float:
        started = time.perf_counter()
        outs = sampler.sample(requests)
        return sum(len(o.sequences[0].tokens) for o in outs) / (time.perf_counter() - started)

    local = statistics.median(batched() for _ in range(3))
    print(f"sampler, {n_requests} concurrent requests over {n_adapters} adapters, {max_tokens} tokens each: "
          f"{served:7.1f} tokens/s "
          f"through the server vs {local:7.1f} tokens/s in-process batched generate = {served / local:.2f}x")


MT_BATCH = 4  # datums of SEQ tokens per tenant step


def tenant_steps(base_url: str, vocab: int, tenants: int, steps: int) -> tuple[float, list[float], int]:
    """Aggregate trained tokens/s, every tenant step's latency (ms) and the errors, for `tenants` concurrent
    Tinker SDK clients on one pool."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=f"tml-bench-mt-{tenants}")
    clients = [service.create_lora_training_client(base_model="tiny-qwen", rank=RANK, seed=k).result()
               for k in range(tenants)]
    rows = token_rows(vocab)
    data = [[types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                         loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * SEQ})
             for r in rows[(k % 2) * MT_BATCH:(k % 2) * MT_BATCH + MT_BATCH]] for k in range(tenants)]
    for k, tc in enumerate(clients):  # warm up each adapter (optimizer state, first-use allocations)
        tc.forward_backward(data[k], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    times: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def run(k: int) -> None:
        for _ in range(steps):
            started = time.perf_counter()
            try:
                fb = clients[k].forward_backward(data[k], "cross_entropy")
                opt = clients[k].optim_step(types.AdamParams(learning_rate=1e-4))
                fb.result()
                opt.result()
            except Exception:  # noqa: BLE001 - counted and reported
                with lock:
                    errors[0] += 1
                continue
            with lock:
                times.append((time.perf_counter() - started) * 1000)

    wall = run_concurrently(run, tenants)
    return len(times) * MT_BATCH * SEQ / wall, times, errors[0]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def multi_tenant_rows(work: Path, threads: str, steps: int, counts: list[int]) -> None:
    """Both servers run side by side and each tenant count is measured on one right after the other, so a
    host whose speed drifts (a shared machine) affects both alike."""
    model_dir = ensure_tiny_model(work / "small" / "tiny-qwen", **SIZES["small"])
    servers = {}
    try:
        for mode, db, clock in (("serial", 10, None), ("fused", 9, {"enabled": True, "max_ops": 2 * max(counts)})):
            (work / mode).mkdir()
            servers[mode] = launch(work / mode, model_dir, db=db, backend="transformers",
                                   max_loras=max(counts) + 1, clock=clock, env={"OMP_NUM_THREADS": threads})
        results = {(mode, count): tenant_steps(servers[mode].base_url, 512, count, steps)
                   for count in counts for mode in ("serial", "fused")}
    finally:
        for server in servers.values():
            server.stop()
    print(f"(d) multi-tenant, small model, each tenant {steps} steps of fb {MT_BATCH}x{SEQ} + optim, rank {RANK} "
          f"(torch threads: {threads})")
    for count in counts:
        line = []
        for mode in ("serial", "fused"):
            rate, times, errors = results[mode, count]
            line.append(f"{mode} {rate:7.0f} tok/s, step p50 {percentile(times, 0.5):6.0f} ms "
                        f"p99 {percentile(times, 0.99):6.0f} ms, errors {errors}")
        ratio = results["fused", count][0] / results["serial", count][0]
        print(f"  {count:>2} tenants: " + " | ".join(line) + f" | fused/serial {ratio:.2f}x")
    # What batching can give on this machine at all: the same step in plain PyTorch, one tenant's batch vs all
    # tenants' rows in one batch. Where these match, a fused pass has no bigger matmul to win on.
    ceiling = {rows: rows * SEQ / in_process_step_ms(model_dir, steps, rows) * 1000
               for rows in (MT_BATCH, MT_BATCH * max(counts))}
    print("  in-process fb + optim (plain PyTorch, one adapter): " + ", ".join(
        f"{rows} rows {rate:.0f} tok/s" for rows, rate in ceiling.items())
        + f" | bigger batch {ceiling[MT_BATCH * max(counts)] / ceiling[MT_BATCH]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", default="tiny,small", help="model sizes for (a): tiny, small")
    parser.add_argument("--multi-tenant", action="store_true", help="run only (d), fused vs serial clock cycles")
    parser.add_argument("--tenants", default="1,4,16", help="tenant counts for (d)")
    parser.add_argument("--full", action="store_true", help="run only (e), full-parameter runs")
    ns = parser.parse_args()
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(threads))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if ns.full:
            full_rows(work, threads, ns.steps)
            return
        if ns.multi_tenant:
            multi_tenant_rows(work, threads, ns.steps, [int(n) for n in ns.tenants.split(",")])
            return
        vocab = 512
        for size in ns.sizes.split(","):
            sized = ensure_tiny_model(work / size / "tiny-qwen", **SIZES[size])  # the name the SDK asks for
            local = in_process_step_ms(sized, ns.steps)
            server = launch(work / size, sized, db=10, backend="transformers", env={"OMP_NUM_THREADS": threads})
            try:
                remote = server_step_ms(server.base_url, vocab, ns.steps)
            finally:
                server.stop()
            print(f"(a) training step, {size} model, batch {BATCH}x{SEQ}, rank {RANK}: server {remote:.1f} ms vs "
                  f"in-process {local:.1f} ms = {remote / local:.3f}x  (torch threads: {threads})")
        model_dir = ensure_tiny_model(work / "tiny-qwen")
        server = launch(work, model_dir, db=10, backend="transformers", sampler=True, max_loras=40,
                        env={"OMP_NUM_THREADS": threads})
        try:
            print("(b)", end=" ")
            memory_rows(server, model_dir)
            for max_tokens in (32, 128):
                print("(c)", end=" ")
                sampler_rows(server, model_dir, max_tokens=max_tokens)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
