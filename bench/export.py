"""Merged exports (`export_merged`) on the small model (hidden 256, 4 layers) through a launched server (CPU).

    python bench/export.py [--steps 3] [--max-shard-size 2MB] [--skip-tied]

For a few LoRA shapes (the Tinker SDK's default of attention, MLP and output head; attention only; a larger rank),
each trained a few steps with the Tinker SDK and saved with save_state, the server merges the checkpoint once
(`TwinkleClient.export_merged`), the client downloads the verified directory (`download_merged`) and loads it
with plain transformers. Prints per export: the merge's own time (load the adapter, merge, save) and the op's wall
time as the client waits for it, the size and shards of the merged model, the differences the server recorded
(PEFT adapter and merged model vs the pool's logprobs on the probe batch), the difference the client measures
itself on another sequence (downloaded model vs the server's forward), and the count of errors. With a tied
variant of the model (its output head sharing the embedding matrix, as small Qwen, Gemma and Llama models do),
the default LoRA on the output head exercises the untying. Targets: every export verified, every difference
<= 1e-3, 0 errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import LaunchedServer, free_port, mock_config
from twinkle.tiny_model import ensure_tiny_model

SIZES = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 1024, "num_heads": 8, "num_kv_heads": 4}
KEY = "tml-bench-export"
SHAPES: dict[str, dict[str, Any]] = {
    "rank 16, attn+mlp+unembed (SDK default)": {"rank": 16},
    "rank 8, attention only": {"rank": 8, "train_mlp": False, "train_unembed": False},
    "rank 64, attn+mlp+unembed": {"rank": 64},
}
SEQ = [11 + (i * 37) % 480 for i in range(65)]


def tied_copy(model_dir: Path, out: Path) -> Path:
    """The model with its output head tied to the input embeddings."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copyfile(model_dir / name, out / name)
    return out


def launch(work: Path, model_dir: Path, db: int, shard: str, threads: str) -> LaunchedServer:
    config = mock_config(model_dir, work / "checkpoints", port=free_port(), db=db, backend="transformers")
    config["applications"][1]["args"]["export"] = {"max_shard_size": shard}
    server = LaunchedServer(config, work / "server.yaml", work / "server.log", env={"OMP_NUM_THREADS": threads})
    server.start(timeout=180)
    return server


def export_rows(server: LaunchedServer, label: str, steps: int, work: Path) -> tuple[list[str], int]:
    import numpy as np
    import tinker
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM

    from twinkle_client import TwinkleClient, TwinkleClientError

    def datum(tokens: list[int]) -> types.Datum:
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

    lines, errors = [], 0
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    with TwinkleClient(server.base_url, KEY) as client:
        for shape, lora in SHAPES.items():
            try:
                tc = service.create_lora_training_client(base_model="tiny-qwen", seed=1, **lora).result()
                for _ in range(steps):
                    fb = tc.forward_backward([datum(SEQ)], "cross_entropy")
                    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                    fb.result()
                server_lp = tc.forward([datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
                path = tc.save_state(f"bench-{len(lines)}").result().path
                began = time.perf_counter()
                export = client.export_merged(path)
                wall = time.perf_counter() - began
                directory = client.download_merged(path, work / f"merged-{label}-{len(lines)}")
                model = AutoModelForCausalLM.from_pretrained(directory).eval()
                with torch.no_grad():
                    logits = model(torch.tensor([SEQ[:-1]])).logits[0].float()
                local = torch.log_softmax(logits, -1)[torch.arange(len(SEQ) - 1), torch.tensor(SEQ[1:])].numpy()
                client_diff = float(np.abs(local - server_lp.to_numpy()).max())
                check = export.export
                ok = export.status == "verified" and client_diff <= check["tolerance"]
                errors += not ok
                lines.append(
                    f"  {label:>6} | {shape:<40} | merge {check['seconds']:5.2f} s, op {wall:5.2f} s | "
                    f"{export.size_bytes / 1e6:5.1f} MB in {check['merged']['shards']} shards | "
                    f"server: adapter {check['adapter']['max_abs_diff']:.1e}, merged "
                    f"{check['merged']['max_abs_diff']:.1e} | client {client_diff:.1e} | {export.status}")
            except (TwinkleClientError, tinker.TinkerError) as error:
                errors += 1
                lines.append(f"  {label:>6} | {shape:<40} | ERROR {error}")
    return lines, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-shard-size", default="2MB", help="export.max_shard_size of the pool")
    parser.add_argument("--skip-tied", action="store_true", help="only the untied model")
    parser.add_argument("--db", type=int, default=10, help="Redis database of the launched servers")
    ns = parser.parse_args()
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        small = ensure_tiny_model(work / "small" / "tiny-qwen", **SIZES)
        models = {"untied": small}
        if not ns.skip_tied:
            models["tied"] = tied_copy(small, work / "tied" / "tiny-qwen")
        print(f"merged exports, small model (hidden 256, 4 layers), {ns.steps} training steps each, shards of at "
              f"most {ns.max_shard_size}, torch threads {threads}")
        total_errors = 0
        for label, model_dir in models.items():
            (work / f"server-{label}").mkdir()
            server = launch(work / f"server-{label}", model_dir, ns.db, ns.max_shard_size, threads)
            try:
                lines, errors = export_rows(server, label, ns.steps, work)
            finally:
                server.stop()
            print("\n".join(lines))
            total_errors += errors
        print(f"errors: {total_errors}")


if __name__ == "__main__":
    main()
