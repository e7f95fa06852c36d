"""Self-cognition SFT with the Twinkle client: the product docs' complete example, runnable offline.

The training loop is local Twinkle code with one import changed: the model is
`twinkle_client.model.MultiLoraTransformersModel`, so forward_backward, clip_grad_and_step, the loss, the
optimizer and the LR schedule all run on the server. The dataset is `twinkle_client.dataset.Dataset`:
loading and preprocessing happen here, encoding on the server's processor pool, so this machine needs no
model files at all.

- gradient accumulation over 2 micro-batches (only every 2nd clip_grad_and_step updates the weights);
- metrics every 2 micro-batches (calculate_metric averages since the previous call);
- a checkpoint per epoch, with the optimizer state and the number of samples consumed;
- `--resume latest` continues from this API key's newest checkpoint of this example: weights, optimizer,
  schedule and step counter come back, and the DataLoader skips the samples already trained on.

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/twinkle/self_host/self_cognition.py --max-steps 20
    python cookbook/client/twinkle/self_host/self_cognition.py --resume latest
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_client.example_connection import require_server, server_messages

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
CHECKPOINT_PREFIX = "twinkle-epoch-"  # how --resume latest recognises this example's checkpoints


@dataclass
class Config:
    base_url: str = os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    api_key: str = os.environ.get("TWINKLE_SERVER_TOKEN", "tml-cookbook")
    base_model: str = os.environ.get("TWINKLE_BASE_MODEL", "tiny-qwen")
    dataset: str = os.environ.get("TWINKLE_DATASET", str(DATA_DIR / "self_cognition.jsonl"))
    max_samples: int = 500
    model_name: str = "twinkle模型"
    model_author: str = "ModelScope社区"
    epochs: int = 3
    max_steps: int = 10_000
    batch_size: int = 4
    gradient_accumulation_steps: int = 2
    learning_rate: float = 5e-3  # for the tiny random model; the docs use 1e-4 for Qwen3.5-4B
    resume: str | None = None


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
    parser.add_argument("--max-samples", type=int, default=d.max_samples, help="rows of the dataset to use")
    parser.add_argument("--model-name", default=d.model_name)
    parser.add_argument("--model-author", default=d.model_author)
    parser.add_argument("--epochs", type=int, default=d.epochs)
    parser.add_argument(
        "--max-steps", type=int, default=d.max_steps, help="stop after this many micro-batches"
    )
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=d.gradient_accumulation_steps)
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument("--resume", default=d.resume, help="'latest' or a twinkle:// checkpoint path")
    return Config(**vars(parser.parse_args(argv)))


def latest_checkpoint(client: Any, base_model: str) -> str | None:
    """The newest checkpoint this example saved under this API key, on this base model."""
    newest = None
    for run in client.list_training_runs(limit=100):
        if run.base_model != base_model:
            continue
        for checkpoint in client.list_checkpoints(run.training_run_id):
            if checkpoint.checkpoint_type != "training" or CHECKPOINT_PREFIX not in checkpoint.checkpoint_id:
                continue
            if newest is None or checkpoint.time > newest.time:
                newest = checkpoint
    return newest.twinkle_path if newest else None


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle import get_logger
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import DatasetMeta
    from twinkle_client import init_twinkle_client
    from twinkle_client.dataset import Dataset
    from twinkle_client.model import MultiLoraTransformersModel

    logger = get_logger()

    # Step 1: connect (this starts a session that heartbeats in the background).
    client = init_twinkle_client(base_url=cfg.base_url, api_key=cfg.api_key)
    print("Available models:")
    for item in client.get_server_capabilities().supported_models:
        print("- " + item.model_name)

    # Step 2: the checkpoint to resume from, if any.
    resume_path = latest_checkpoint(client, cfg.base_model) if cfg.resume == "latest" else cfg.resume
    if cfg.resume == "latest" and resume_path is None:
        print("no earlier checkpoint of this example: starting fresh")

    # Step 3: the data. The template is named, not loaded: the server's processor pool encodes.
    dataset = Dataset(dataset_meta=DatasetMeta(cfg.dataset, data_slice=range(cfg.max_samples)))
    dataset.set_template("Qwen3_5Template", model_id=cfg.base_model, max_length=512)
    dataset.map(
        "SelfCognitionProcessor", init_args={"model_name": cfg.model_name, "model_author": cfg.model_author}
    )
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=cfg.batch_size)

    # Step 4: the adapter and its training setup, kept on the server. A dict stands in for
    # peft.LoraConfig(target_modules='all-linear'), which works too but takes seconds to import.
    model = MultiLoraTransformersModel(model_id=cfg.base_model)
    lora_config = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    model.add_adapter_to_model(
        "default", lora_config, gradient_accumulation_steps=cfg.gradient_accumulation_steps
    )
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("Adam", lr=cfg.learning_rate)
    # On the Megatron backend: model.set_optimizer('default', lr=...) and set_lr_scheduler('default', ...).

    # Step 5: resume. The progress says how many samples the checkpoint had consumed; skip exactly those.
    start_step = 0
    if resume_path:
        logger.info(f"Resuming from checkpoint {resume_path}")
        progress = model.resume_from_checkpoint(resume_path)
        dataloader.resume_from_checkpoint(progress["consumed_train_samples"])
        start_step = progress["cur_step"] * cfg.gradient_accumulation_steps
        consumed = progress["consumed_train_samples"]
        print(f"resumed at optimizer step {progress['cur_step']}, {consumed} samples in")

    # Step 6: train.
    logger.info(model.get_train_configs().model_dump())
    step = start_step
    done = 0
    for epoch in range(dataloader.epoch, cfg.epochs):
        logger.info(f"Starting epoch {epoch}")
        for batch in dataloader:
            step += 1
            done += 1
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()  # clip, step, zero_grad, lr step: every 2nd call with accumulation 2
            if step % 2 == 0:
                metric = model.calculate_metric(is_training=True)
                print(f"step {step} of {len(dataloader)} per epoch, metric: {metric.result}", flush=True)
            if done >= cfg.max_steps:
                break
        # Step 7: a checkpoint per epoch (and where --max-steps stopped), resumable mid-epoch.
        twinkle_path = model.save(
            name=f"{CHECKPOINT_PREFIX}{epoch}-step-{step}",
            save_optimizer=True,
            consumed_train_samples=dataloader.get_state()["consumed_train_samples"],
        )
        print(f"Saved checkpoint: {twinkle_path}")
        if done >= cfg.max_steps:
            break

    # Step 8 (optional): upload to the ModelScope hub.
    # model.upload_to_hub(checkpoint_dir=twinkle_path, hub_model_id='<user>/twinkle-self-cognition')
    client.close()


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
