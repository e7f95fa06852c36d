"""DPO with the Twinkle client: the server's DPOLoss on batches of preference pairs.

Each row of the preference dataset becomes two trajectories, [positive, negative], and the DataLoader keeps
that order (no shuffling), so every batch is [pos_1, neg_1, pos_2, neg_2, ...]. The trajectories go to the
server as they are; it encodes them with the template set on the model. DPOLoss compares the adapter with
the bare base model, whose logprobs the server computes in the same call with the adapter switched off:

    loss = -log σ(β · ((Σ lp_chosen - Σ ref_chosen) - (Σ lp_rejected - Σ ref_rejected)))

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/twinkle/self_host/dpo.py --max-steps 20
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from twinkle_client.example_connection import require_server, server_messages

DATA_DIR = Path(__file__).resolve().parents[3] / "data"


@dataclass
class Config:
    base_url: str = os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    api_key: str = os.environ.get("TWINKLE_SERVER_TOKEN", "tml-cookbook")
    base_model: str = os.environ.get("TWINKLE_BASE_MODEL", "tiny-qwen")
    dataset: str = os.environ.get("TWINKLE_DATASET", str(DATA_DIR / "dpo_pairs.jsonl"))
    chosen_key: str = "answer_zh"
    rejected_key: str = "answer_en"
    max_samples: int = 500
    max_steps: int = 20
    pairs_per_batch: int = 4
    beta: float = 0.1
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
    parser.add_argument("--dataset", default=d.dataset, help="path or ms:// / hf:// id (env TWINKLE_DATASET)")
    parser.add_argument("--chosen-key", default=d.chosen_key)
    parser.add_argument("--rejected-key", default=d.rejected_key)
    parser.add_argument("--max-samples", type=int, default=d.max_samples, help="preference rows to use")
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--pairs-per-batch", type=int, default=d.pairs_per_batch)
    parser.add_argument(
        "--beta", type=float, default=d.beta, help="how far the policy may move from the reference"
    )
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    return Config(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import DPOProcessor
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel

    client = init_twinkle_client(base_url=cfg.base_url, api_key=cfg.api_key)

    dataset = Dataset(dataset_meta=DatasetMeta(cfg.dataset, data_slice=range(cfg.max_samples)))
    dataset.map(
        DPOProcessor(chosen_key=cfg.chosen_key, rejected_key=cfg.rejected_key), load_from_cache_file=False
    )
    # Two trajectories per row, in order; a batch must hold whole pairs, so no shuffling and no short tail.
    dataloader = DataLoader(dataset=dataset, batch_size=2 * cfg.pairs_per_batch, drop_last=True)
    print(f"{len(dataset) // 2} preference pairs from {cfg.dataset}")

    model = MultiLoraTransformersModel(model_id=cfg.base_model)
    model.add_adapter_to_model("default", {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
    model.set_template("Qwen3_5Template")  # the server encodes the trajectories with it
    model.set_loss("DPOLoss", beta=cfg.beta)
    model.set_optimizer("AdamW", lr=cfg.learning_rate)
    print(f"training LoRA adapter {model.training_run_id} on {cfg.base_model} with DPOLoss (beta {cfg.beta})")

    step = 0
    while step < cfg.max_steps:
        for batch in dataloader:
            step += 1
            result = model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            m = result.metrics
            pair_loss = m["loss:sum"] / (len(batch) // 2)
            print(
                f"step {step}/{cfg.max_steps} loss {pair_loss:.4f} accuracy {m['dpo_accuracy:mean']:.2f} "
                f"margin {m['dpo_margin:mean']:.4f} chosen {m['dpo_rewards/chosen:mean']:.4f} "
                f"rejected {m['dpo_rewards/rejected:mean']:.4f}",
                flush=True,
            )
            if step >= cfg.max_steps:
                break

    twinkle_path = model.save(name=f"dpo-step-{step}", save_optimizer=True)
    print(f"Saved checkpoint: {twinkle_path}")
    client.close()


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
