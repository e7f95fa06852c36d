"""LoRA training with the unmodified Tinker SDK: teach the model Pig Latin.

Each example is the prompt `English: <words>\\nPig Latin:` and the completion ` <pig latin>\\n\\n`. The loss
weight is 1 on the completion's tokens only, so the model learns to answer rather than to repeat prompts.

The loop is pipelined: step t+1's forward_backward and optim_step are submitted before step t's results
are read, so the server always has the next request queued while this process prepares the next batch.
At the end the adapter is saved with save_state (a resumable checkpoint) and sampled.

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/tinker/self_host/lora.py --max-steps 40

`--resume tinker://.../weights/<name>` continues from a checkpoint, optimizer state included.
"""

from __future__ import annotations

import argparse
import json
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
    dataset: str = os.environ.get("TWINKLE_DATASET", str(DATA_DIR / "pig_latin.jsonl"))
    max_steps: int = 40
    batch_size: int = 8
    rank: int = 16
    learning_rate: float = 5e-3  # for the tiny random model; real models train well around 1e-4
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
    parser.add_argument(
        "--dataset", default=d.dataset, help="jsonl of {input, output} pairs (env TWINKLE_DATASET)"
    )
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--rank", type=int, default=d.rank, help="LoRA rank")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument("--resume", default=d.resume, help="checkpoint path to continue from")
    return Config(**vars(parser.parse_args(argv)))


def pig_latin_datum(tokenizer: Any, english: str, pig_latin: str) -> Any:
    """Prompt and completion as one next-token example, weighted on the completion only."""
    from tinker import types

    prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=False)
    completion = tokenizer.encode(f" {pig_latin}\n\n", add_special_tokens=False)
    tokens = prompt + completion
    weights = [0.0] * len(prompt) + [1.0] * len(completion)
    # Position t predicts token t+1: inputs drop the last token, targets and weights the first.
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle import init_tinker_client

    init_tinker_client()  # twinkle:// paths and free-form keys; everything else is the plain SDK
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    if cfg.resume:
        training = service.create_training_client_from_state_with_optimizer(cfg.resume).result()
        print(f"resumed {cfg.resume} as {training.model_id}")
    else:
        training = service.create_lora_training_client(base_model=cfg.base_model, rank=cfg.rank).result()
        print(f"training LoRA adapter {training.model_id} (rank {cfg.rank}) on {cfg.base_model}")
    tokenizer = training.get_tokenizer()

    rows = [json.loads(line) for line in Path(cfg.dataset).read_text().splitlines() if line.strip()]
    data = [pig_latin_datum(tokenizer, row["input"], row["output"]) for row in rows]
    print(f"{len(data)} Pig Latin pairs from {cfg.dataset}")
    adam = types.AdamParams(learning_rate=cfg.learning_rate)

    def report(step: int, batch: list[Any], forward_backward: Any, optim: Any) -> None:
        weight = sum(float(sum(d.loss_fn_inputs["weights"].tolist())) for d in batch)
        loss = forward_backward.result().metrics["loss:sum"] / weight
        grad_norm = optim.result().metrics.get("grad_norm:mean", float("nan"))
        print(f"step {step}/{cfg.max_steps} loss {loss:.4f} grad_norm {grad_norm:.3f}", flush=True)

    pending: tuple[int, list[Any], Any, Any] | None = None
    for step in range(1, cfg.max_steps + 1):
        start = (step - 1) * cfg.batch_size % len(data)
        batch = (data[start:] + data[:start])[: cfg.batch_size]
        # Submit this step before waiting on the previous one: the requests queue up in order on the server.
        forward_backward = training.forward_backward(batch, "cross_entropy")
        optim = training.optim_step(adam)
        if pending is not None:
            report(*pending)
        pending = (step, batch, forward_backward, optim)
    if pending is not None:
        report(*pending)

    saved = training.save_state(f"pig-latin-step-{cfg.max_steps}").result()
    print(f"Saved checkpoint to {saved.path}")

    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=16, temperature=0.0, stop=["\n"])
    for english in ("hello world", "coffee break"):
        prompt = types.ModelInput.from_ints(tokenizer.encode(f"English: {english}\nPig Latin:"))
        result = sampler.sample(prompt=prompt, sampling_params=params, num_samples=1).result()
        print(f"sample: {english!r} -> {tokenizer.decode(result.sequences[0].tokens).strip()!r}")


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
