"""Sample from a saved adapter with the Twinkle client's Sampler.

The adapter is `--adapter-path` (a `twinkle://` checkpoint path) or, by default, the newest checkpoint of
this API key, e.g. one saved by self_cognition.py. The prompt is a Trajectory (system + user); the sampler
encodes it with the chat template and an open assistant turn, and decodes what comes back.

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/twinkle/self_host/sample.py --question "你是谁？"

The template needs the model's tokenizer on this machine: `--model-dir` (env TWINKLE_MODEL_DIR), by default
the tokenizer files the server serves for the checkpoint's base model (downloaded once), else its hub name.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from twinkle_client.example_connection import require_server, server_messages, tokenizer_dir


@dataclass
class Config:
    base_url: str = os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    api_key: str = os.environ.get("TWINKLE_SERVER_TOKEN", "tml-cookbook")
    adapter_path: str | None = os.environ.get("TWINKLE_CHECKPOINT")
    model_dir: str | None = os.environ.get("TWINKLE_MODEL_DIR")
    question: str = "你是谁？"
    num_samples: int = 4
    max_tokens: int = 50
    temperature: float = 0.7
    max_steps: int = 1  # sampling rounds; every example takes --max-steps


def parse_args(argv: list[str] | None = None, defaults: Config | None = None) -> Config:
    d = defaults or Config()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=d.base_url, help="server address (env TWINKLE_SERVER_URL)")
    parser.add_argument("--api-key", default=d.api_key, help="API key (env TWINKLE_SERVER_TOKEN)")
    parser.add_argument(
        "--adapter-path", default=d.adapter_path, help="checkpoint to sample; default: the newest"
    )
    parser.add_argument(
        "--model-dir", default=d.model_dir, help="tokenizer for the template (env TWINKLE_MODEL_DIR)"
    )
    parser.add_argument("--question", default=d.question)
    parser.add_argument("--num-samples", type=int, default=d.num_samples)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help="sampling rounds")
    return Config(**vars(parser.parse_args(argv)))


def newest_checkpoint(client: Any) -> str | None:
    """The newest training checkpoint over all of this API key's runs."""
    paths = []
    for run in client.list_training_runs(limit=100):
        checkpoint = run.last_checkpoint
        if checkpoint is not None:
            paths.append((checkpoint.time, checkpoint.twinkle_path))
    return max(paths)[1] if paths else None


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle.data_format import Message, Trajectory
    from twinkle_client import init_twinkle_client
    from twinkle_client.sampler import Sampler

    client = init_twinkle_client(base_url=cfg.base_url, api_key=cfg.api_key)
    path = cfg.adapter_path or newest_checkpoint(client)
    if path is None:
        raise SystemExit(
            "This API key has no checkpoints yet: run self_cognition.py first, or pass --adapter-path."
        )
    base_model = client.get_weights_info(path).base_model
    print(f"Sampling from checkpoint {path} (base model {base_model})")

    sampler = Sampler(model_id=base_model)
    sampler.set_template(
        "Qwen3_5Template", model_id=cfg.model_dir or tokenizer_dir(cfg.base_url, cfg.api_key, base_model)
    )
    trajectory = Trajectory(
        messages=[
            Message(role="system", content="You are a helpful assistant."),
            Message(role="user", content=cfg.question),
        ]
    )
    params = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    for step in range(1, cfg.max_steps + 1):
        result = sampler.sample(
            trajectory, sampling_params=params, adapter_path=path, num_samples=cfg.num_samples
        )
        assert not isinstance(result, list)  # one prompt in, one result out
        logprobs = [lp for sequence in result.sequences for lp in (sequence.logprobs or [])]
        mean = sum(logprobs) / len(logprobs) if logprobs else float("nan")
        print(f"step {step}/{cfg.max_steps} metric mean_logprob {mean:.4f} sequences {len(result.sequences)}")
        for index, sequence in enumerate(result.sequences):
            print(f"{index}: {sequence.text!r} ({sequence.stop_reason})")
    client.close()


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
