"""Sample from a saved adapter with the Tinker SDK, on a chat prompt built with Twinkle's Template.

The checkpoint is `--checkpoint` (a `tinker://` or `twinkle://` path, training or sampler weights) or, by
default, the newest checkpoint of this API key that the RestClient lists, e.g. one that lora.py or
self_cognition.py saved. The prompt is a system + user conversation rendered with the model's chat
template and an open assistant turn; each completion is printed with its mean token logprob.

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/tinker/self_host/sample.py --question "你是谁？"

The template needs the model's tokenizer on this machine: `--model-dir` (env TWINKLE_MODEL_DIR), by default
the tokenizer files the server serves for the checkpoint's base model (downloaded once), else its hub name.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from twinkle_client.example_connection import require_server, server_messages, tokenizer_dir


@dataclass
class Config:
    base_url: str = os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    api_key: str = os.environ.get("TWINKLE_SERVER_TOKEN", "tml-cookbook")
    checkpoint: str | None = os.environ.get("TWINKLE_CHECKPOINT")
    model_dir: str | None = os.environ.get("TWINKLE_MODEL_DIR")
    question: str = "你是谁？"
    num_samples: int = 4
    max_tokens: int = 50
    temperature: float = 0.2
    max_steps: int = 1  # sampling rounds; every example takes --max-steps


def parse_args(argv: list[str] | None = None, defaults: Config | None = None) -> Config:
    d = defaults or Config()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=d.base_url, help="server address (env TWINKLE_SERVER_URL)")
    parser.add_argument("--api-key", default=d.api_key, help="API key (env TWINKLE_SERVER_TOKEN)")
    parser.add_argument(
        "--checkpoint", default=d.checkpoint, help="path to sample from; default: the newest one"
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


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle import init_tinker_client

    init_tinker_client()  # lets the SDK take twinkle:// paths
    import tinker
    from tinker import ServiceClient, types

    from twinkle.data_format import Message, Trajectory
    from twinkle.template import Template

    service = ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    rest = tinker.RestClient(base_url=cfg.base_url, api_key=cfg.api_key)
    path = cfg.checkpoint
    if path is None:
        checkpoints = rest.list_user_checkpoints().result().checkpoints
        if not checkpoints:
            raise SystemExit(
                "This API key has no checkpoints yet: run lora.py or self_cognition.py first, "
                "or pass --checkpoint."
            )
        path = max(checkpoints, key=lambda checkpoint: checkpoint.time).tinker_path
    base_model = rest.get_weights_info_by_tinker_path(path).result().base_model
    print(f"Sampling from checkpoint {path} (base model {base_model})")

    sampler = service.create_sampling_client(model_path=path).result()
    template = Template(model_id=cfg.model_dir or tokenizer_dir(cfg.base_url, cfg.api_key, base_model))
    trajectory = Trajectory(
        messages=[
            Message(role="system", content="You are a helpful assistant."),
            Message(role="user", content=cfg.question),
        ]
    )
    input_ids = template.batch_encode([trajectory], add_generation_prompt=True)[0]["input_ids"].tolist()
    prompt = types.ModelInput.from_ints(input_ids)
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)

    for step in range(1, cfg.max_steps + 1):
        result = sampler.sample(prompt=prompt, sampling_params=params, num_samples=cfg.num_samples).result()
        logprobs = [lp for sequence in result.sequences for lp in (sequence.logprobs or [])]
        tokens = sum(len(sequence.tokens) for sequence in result.sequences)
        mean = sum(logprobs) / len(logprobs) if logprobs else float("nan")
        print(f"step {step}/{cfg.max_steps} metric mean_logprob {mean:.4f} tokens {tokens}")
        for index, sequence in enumerate(result.sequences):
            print(f"{index}: {template.decode(sequence.tokens)!r} ({sequence.stop_reason})")


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
