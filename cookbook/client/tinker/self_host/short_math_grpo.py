"""GRPO on short math problems with the Tinker SDK: sample, reward the right answers, reinforce them.

Each step:
1. save the current weights and get a sampling client for them (save_weights_and_get_sampling_client);
2. sample a group of completions per question (the sampler returns each token's logprob);
3. reward each completion 1 if its final answer equals the ground truth (twinkle.preprocessor.rewards);
4. advantage = (reward - group mean) / (group std + eps): better than the group's other tries is positive;
   groups where every try scored the same teach nothing and are skipped;
5. one Datum per completion with target_tokens, the sampling logprobs and the advantage on the completion's
   tokens (0 on the prompt), trained with the `importance_sampling` (or clipped `ppo`) loss.

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/tinker/self_host/short_math_grpo.py --max-steps 20

The prompts come from a GSM8K-format dataset ({question, answer ending in '#### <number>'}), by default the
toy problems in cookbook/data/gsm8k_toy.jsonl; `--dataset ms://modelscope/gsm8k` with `--subset main` for
the real one. docs/cookbook_grpo_run.md shows a toy task on which the tiny CPU model's reward rises.
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
    dataset: str = os.environ.get("TWINKLE_DATASET", str(DATA_DIR / "gsm8k_toy.jsonl"))
    subset: str | None = None
    max_samples: int = 500
    system: str | None = None  # None: GSM8KProcessor's instruction to end with '#### <number>'
    max_steps: int = 20
    questions_per_step: int = 4
    group_size: int = 4
    max_tokens: int = 64
    temperature: float = 1.0
    loss: str = "importance_sampling"
    rank: int = 16
    learning_rate: float = 1e-3  # for the tiny random model; real models use about 1e-5
    seed: int = 0


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
    parser.add_argument("--subset", default=d.subset, help="hub subset, e.g. main for ms://modelscope/gsm8k")
    parser.add_argument("--max-samples", type=int, default=d.max_samples, help="questions to use")
    parser.add_argument("--system", default=d.system, help="system prompt; '' for none")
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--questions-per-step", type=int, default=d.questions_per_step)
    parser.add_argument(
        "--group-size", type=int, default=d.group_size, help="completions sampled per question"
    )
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="longest completion")
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--loss", default=d.loss, choices=["importance_sampling", "ppo"])
    parser.add_argument("--rank", type=int, default=d.rank, help="LoRA rank")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument("--seed", type=int, default=d.seed)
    return Config(**vars(parser.parse_args(argv)))


def group_advantages(rewards: list[float]) -> list[float]:
    """Rewards normalised within their group; all zeros when the group's rewards are all equal."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards] if std > 0 else [0.0] * len(rewards)


def rl_datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> Any:
    """One sampled completion as a training example: the loss falls on the completion's tokens only."""
    from tinker import types

    tokens = prompt + completion
    n_prompt = len(prompt) - 1  # targets that are prompt tokens (the first token is never a target)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + list(logprobs),
            "advantages": [0.0] * n_prompt + [advantage] * len(completion),
        },
    )


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle import init_tinker_client

    init_tinker_client()
    import random

    from tinker import ServiceClient, types

    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import GSM8KProcessor, math_accuracy_reward
    from twinkle.preprocessor.gsm8k import DEFAULT_SYSTEM

    service = ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    training = service.create_lora_training_client(
        base_model=cfg.base_model, rank=cfg.rank, seed=cfg.seed
    ).result()
    model_dir = cfg.model_dir or training.get_info().model_data.tokenizer_id or cfg.base_model
    tokenizer = training.get_tokenizer()
    print(f"training LoRA adapter {training.model_id} on {cfg.base_model}")

    # Prompts only (system + user, then an open assistant turn); the ground truth rides in `extra`.
    # Only hub datasets have subsets; a local file or folder given with --dataset ignores the hosted default.
    subset = cfg.subset if "://" in cfg.dataset else None
    meta = DatasetMeta(cfg.dataset, subset_name=subset, data_slice=range(cfg.max_samples))
    dataset = Dataset(dataset_meta=meta)
    dataset.set_template("Qwen3_5Template", model_id=model_dir, max_length=512)
    dataset.map(
        GSM8KProcessor(system=DEFAULT_SYSTEM if cfg.system is None else cfg.system),
        load_from_cache_file=False,
    )
    dataset.encode(add_generation_prompt=True, load_from_cache_file=False)
    questions = [(feature["input_ids"].tolist(), feature["extra"]["ground_truth"]) for feature in dataset]
    print(f"{len(questions)} questions from {cfg.dataset}")

    rng = random.Random(cfg.seed)
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
    adam = types.AdamParams(learning_rate=cfg.learning_rate)
    for step in range(1, cfg.max_steps + 1):
        sampler = training.save_weights_and_get_sampling_client().result()
        chosen = rng.sample(questions, min(cfg.questions_per_step, len(questions)))
        futures = [
            sampler.sample(
                prompt=types.ModelInput.from_ints(prompt), sampling_params=params, num_samples=cfg.group_size
            )
            for prompt, _ in chosen
        ]
        data, rewards = [], []
        for (prompt, truth), future in zip(chosen, futures, strict=True):
            sequences = future.result().sequences
            group = [
                math_accuracy_reward(tokenizer.decode(s.tokens, skip_special_tokens=True), truth)
                for s in sequences
            ]
            rewards.extend(group)
            for sequence, advantage in zip(sequences, group_advantages(group), strict=True):
                if advantage != 0.0 and sequence.tokens:
                    data.append(
                        rl_datum(prompt, list(sequence.tokens), list(sequence.logprobs or []), advantage)
                    )
        mean_reward = sum(rewards) / len(rewards)
        if not data:  # every group all right or all wrong: no signal, but the step still counts
            print(
                f"step {step}/{cfg.max_steps} reward {mean_reward:.3f} loss n/a (no group had mixed rewards)"
            )
            continue
        forward_backward = training.forward_backward(data, cfg.loss)
        optim = training.optim_step(adam)
        loss = forward_backward.result().metrics["loss:sum"] / len(data)
        optim.result()
        print(
            f"step {step}/{cfg.max_steps} reward {mean_reward:.3f} loss {loss:.4f} datums {len(data)}",
            flush=True,
        )

    saved = training.save_state(f"grpo-step-{cfg.max_steps}").result()
    print(f"Saved checkpoint to {saved.path}")


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
