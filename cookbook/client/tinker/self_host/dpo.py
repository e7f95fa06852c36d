"""DPO with the Tinker SDK: prefer the chosen answer of each preference pair over the rejected one.

The Tinker API has no server-side DPO loss, so the loss runs here, with `forward_backward_custom`: the SDK
asks the server for the policy's logprobs, differentiates the loss below on this machine, and sends the
gradient back as per-token weights for the server's backward pass.

DPO compares the policy with a frozen reference model. A fresh LoRA adapter is exactly the base model (its
B matrices start at zero), so one forward pass before the first optimizer step gives the reference
logprobs of every example; they ride along in each Datum under `ref_logprobs` (custom losses see every
loss_fn_inputs field; only target_tokens and weights go to the server).

    loss = -log σ(β · ((Σ lp_chosen - Σ ref_chosen) - (Σ lp_rejected - Σ ref_rejected)))

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/tinker/self_host/dpo.py --max-steps 20
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_client.example_connection import require_server, server_messages

DATA_DIR = Path(__file__).resolve().parents[3] / "data"


@dataclass
class Config:
    base_url: str = os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    api_key: str = os.environ.get("TWINKLE_SERVER_TOKEN", "tml-cookbook")
    base_model: str = os.environ.get("TWINKLE_BASE_MODEL", "tiny-qwen")
    model_dir: str | None = os.environ.get("TWINKLE_MODEL_DIR")
    dataset: str = os.environ.get("TWINKLE_DATASET", str(DATA_DIR / "dpo_pairs.jsonl"))
    chosen_key: str = "answer_zh"
    rejected_key: str = "answer_en"
    max_samples: int = 500
    max_steps: int = 20
    pairs_per_batch: int = 4
    beta: float = 0.1
    rank: int = 16
    learning_rate: float = 1e-3  # for the tiny random model; real models use about 5e-6 to 1e-5


def parse_args(argv: list[str] | None = None, defaults: Config | None = None) -> Config:
    d = defaults or Config()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=d.base_url, help="server address (env TWINKLE_SERVER_URL)")
    parser.add_argument("--api-key", default=d.api_key, help="API key (env TWINKLE_SERVER_TOKEN)")
    parser.add_argument(
        "--base-model", default=d.base_model, help="served base model (env TWINKLE_BASE_MODEL)"
    )
    parser.add_argument(
        "--model-dir", default=d.model_dir, help="tokenizer for the template (env TWINKLE_MODEL_DIR)"
    )
    parser.add_argument("--dataset", default=d.dataset, help="path or ms:// / hf:// id (env TWINKLE_DATASET)")
    parser.add_argument("--chosen-key", default=d.chosen_key)
    parser.add_argument("--rejected-key", default=d.rejected_key)
    parser.add_argument("--max-samples", type=int, default=d.max_samples, help="preference rows to use")
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--pairs-per-batch", type=int, default=d.pairs_per_batch)
    parser.add_argument(
        "--beta", type=float, default=d.beta, help="how far the policy may move from the reference"
    )
    parser.add_argument("--rank", type=int, default=d.rank, help="LoRA rank")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    return Config(**vars(parser.parse_args(argv)))


def dpo_loss(beta: float) -> Any:
    """The custom loss: data come as pairs [chosen_1, rejected_1, chosen_2, ...]."""
    import torch
    import torch.nn.functional as F

    def loss_fn(data: list[Any], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        rewards = []
        for datum, policy in zip(data, logprobs, strict=True):
            weights = datum.loss_fn_inputs["weights"].to_torch()
            reference = datum.loss_fn_inputs["ref_logprobs"].to_torch()
            rewards.append(beta * (weights * (policy - reference)).sum())
        chosen, rejected = torch.stack(rewards[0::2]), torch.stack(rewards[1::2])
        margin = chosen - rejected
        loss = -F.logsigmoid(margin).mean()
        metrics = {
            "dpo_loss": float(loss.detach()),
            "accuracy": float((margin > 0).float().mean()),
            "margin": float(margin.detach().mean()),
        }
        return loss, metrics

    return loss_fn


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle import init_tinker_client

    init_tinker_client()
    from tinker import ServiceClient, types

    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.input_feature import input_feature_to_datum
    from twinkle.preprocessor import DPOProcessor

    service = ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    training = service.create_lora_training_client(base_model=cfg.base_model, rank=cfg.rank).result()
    model_dir = cfg.model_dir or training.get_info().model_data.tokenizer_id or cfg.base_model
    print(f"training LoRA adapter {training.model_id} on {cfg.base_model}")

    # Each row becomes two trajectories, [positive, negative], so the encoded rows come in pairs.
    dataset = Dataset(dataset_meta=DatasetMeta(cfg.dataset, data_slice=range(cfg.max_samples)))
    dataset.set_template("Qwen3_5Template", model_id=model_dir, max_length=256)
    dataset.map(
        DPOProcessor(chosen_key=cfg.chosen_key, rejected_key=cfg.rejected_key), load_from_cache_file=False
    )
    dataset.encode(batched=True, load_from_cache_file=False)
    data = [input_feature_to_datum(feature) for feature in dataset]
    pairs = len(data) // 2
    print(f"{pairs} preference pairs from {cfg.dataset}")

    # Reference logprobs: the untrained adapter is the base model, so a forward pass now gives them.
    size = 2 * cfg.pairs_per_batch
    for start in range(0, len(data), size):
        chunk = data[start : start + size]
        outputs = training.forward(chunk, "cross_entropy").result().loss_fn_outputs
        for datum, output in zip(chunk, outputs, strict=True):
            datum.loss_fn_inputs["ref_logprobs"] = types.TensorData.from_numpy(output["logprobs"].to_numpy())
    print("reference logprobs computed")

    loss_fn = dpo_loss(cfg.beta)
    adam = types.AdamParams(learning_rate=cfg.learning_rate)
    batches_per_epoch = max(1, pairs // cfg.pairs_per_batch)
    for step in range(1, cfg.max_steps + 1):
        start = (step - 1) % batches_per_epoch * size
        batch = data[start : start + size]
        forward_backward = training.forward_backward_custom(batch, loss_fn)
        optim = training.optim_step(adam)  # queued behind the custom backward; runs once it is done
        metrics = forward_backward.result().metrics
        optim.result()
        print(
            f"step {step}/{cfg.max_steps} loss {metrics['dpo_loss']:.4f} "
            f"accuracy {metrics['accuracy']:.2f} margin {metrics['margin']:.4f}",
            flush=True,
        )

    saved = training.save_state(f"dpo-step-{cfg.max_steps}").result()
    print(f"Saved checkpoint to {saved.path}")


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
