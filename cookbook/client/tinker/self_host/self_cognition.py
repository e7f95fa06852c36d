"""Self-cognition SFT with the Tinker SDK and Twinkle's data library: teach the model its name and author.

The data side is local Twinkle code (Dataset, Template, SelfCognitionProcessor, DataLoader); each
encoded InputFeature becomes a Tinker Datum with `input_feature_to_datum` (labels -100 get weight 0), and
the training side is the plain Tinker SDK: forward_backward with cross_entropy, optim_step, one save_state
per epoch. Finally a sampling client is opened on the saved weights by their `twinkle://` path (which
`init_tinker_client` teaches the SDK to accept) and asked "who are you?".

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/tinker/self_host/self_cognition.py --max-steps 30

The template needs the model's tokenizer on this machine: `--model-dir` (env TWINKLE_MODEL_DIR), by default
the tokenizer the server reports, which for a self-hosted server is a local directory or a hub id.
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
    model_dir: str | None = os.environ.get("TWINKLE_MODEL_DIR")
    dataset: str = os.environ.get("TWINKLE_DATASET", str(DATA_DIR / "self_cognition.jsonl"))
    max_samples: int = 500
    model_name: str = "twinkle模型"
    model_author: str = "twinkle团队"
    epochs: int = 3
    max_steps: int = 10_000
    batch_size: int = 8
    rank: int = 16
    learning_rate: float = 5e-3  # for the tiny random model; real models train well around 1e-4


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
    parser.add_argument("--max-samples", type=int, default=d.max_samples, help="rows of the dataset to use")
    parser.add_argument("--model-name", default=d.model_name)
    parser.add_argument("--model-author", default=d.model_author)
    parser.add_argument("--epochs", type=int, default=d.epochs)
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--rank", type=int, default=d.rank, help="LoRA rank")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    return Config(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle import init_tinker_client

    # Before any client exists: the SDK then accepts twinkle:// paths and keys without the tml- prefix.
    init_tinker_client()
    import numpy as np
    from tinker import ServiceClient, types

    from twinkle.data_format import Message, Trajectory
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.input_feature import input_feature_to_datum
    from twinkle.preprocessor import SelfCognitionProcessor
    from twinkle.template import Template

    service = ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    training = service.create_lora_training_client(base_model=cfg.base_model, rank=cfg.rank).result()
    model_dir = cfg.model_dir or training.get_info().model_data.tokenizer_id or cfg.base_model
    print(f"training LoRA adapter {training.model_id} on {cfg.base_model} (template from {model_dir})")

    dataset = Dataset(dataset_meta=DatasetMeta(cfg.dataset, data_slice=range(cfg.max_samples)))
    dataset.set_template("Qwen3_5Template", model_id=model_dir, max_length=256)
    dataset.map(SelfCognitionProcessor(cfg.model_name, cfg.model_author), load_from_cache_file=False)
    dataset.encode(batched=True, load_from_cache_file=False)
    dataloader = DataLoader(dataset=dataset, batch_size=cfg.batch_size, shuffle=True)
    print(f"{len(dataset)} conversations, {len(dataloader)} batches per epoch")

    step = 0
    for epoch in range(cfg.epochs):
        for batch in dataloader:
            step += 1
            data = [input_feature_to_datum(feature) for feature in batch]
            forward_backward = training.forward_backward(data, "cross_entropy")
            optim = training.optim_step(types.AdamParams(learning_rate=cfg.learning_rate))
            result, optim_result = forward_backward.result(), optim.result()
            # The loss per token, from the returned logprobs and the weights sent (the server sums the loss).
            logprobs = np.concatenate([output["logprobs"].tolist() for output in result.loss_fn_outputs])
            weights = np.concatenate([datum.loss_fn_inputs["weights"].tolist() for datum in data])
            loss = -np.dot(logprobs, weights) / weights.sum()
            print(f"epoch {epoch} step {step} loss {loss:.4f} metrics {optim_result.metrics}", flush=True)
            if step >= cfg.max_steps:
                break
        saved = training.save_state(f"twinkle-lora-{epoch}").result()
        print(f"Saved checkpoint to {saved.path}")
        if step >= cfg.max_steps:
            break

    # Sample from the saved weights through their twinkle:// path, as a separate user of them would.
    twinkle_path = saved.path.replace("tinker://", "twinkle://", 1)
    sampler = service.create_sampling_client(model_path=twinkle_path).result()
    template = Template(model_id=model_dir)
    trajectory = Trajectory(
        messages=[
            Message(role="system", content="You are a helpful assistant."),
            Message(role="user", content="你是谁？"),
        ]
    )
    prompt = template.batch_encode([trajectory], add_generation_prompt=True)[0]["input_ids"].tolist()
    params = types.SamplingParams(max_tokens=40, temperature=0.2)
    samples = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt), sampling_params=params, num_samples=2
    ).result()
    print(f"sampling from {twinkle_path}")
    for index, sequence in enumerate(samples.sequences):
        print(f"sample {index}: {template.decode(sequence.tokens)!r}")


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
