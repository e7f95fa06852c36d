"""GRPO on short math problems with the Twinkle client: the server's GRPOLoss, advantages, old logprobs.

Each step:
1. save the adapter's weights for sampling (`model.save(..., is_sampler=True)`) and sample a group of
   completions per question from them (`Sampler.sample(..., adapter_path=...)`, with token logprobs);
2. reward each completion 1 if its final answer equals the ground truth (twinkle.preprocessor.rewards);
3. advantage = (reward - group mean) / (group std + eps); groups whose tries all scored the same are skipped;
4. one InputFeature per completion: input_ids = prompt + completion, labels -100 on the prompt, and per
   input token `advantages` and `old_logps` (0 on the prompt): GRPOLoss is PPO's clipped objective on the
   ratio between the current policy and the one that sampled.

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/twinkle/self_host/short_math_grpo.py --max-steps 20

The template needs the model's tokenizer on this machine (the prompts are encoded and the completions
decoded here): `--model-dir` (env TWINKLE_MODEL_DIR), by default the tokenizer files the server serves for the
base model (downloaded once), else its hub name.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_client.example_connection import require_server, server_messages, tokenizer_dir

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
IGNORE_INDEX = -100


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
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument("--seed", type=int, default=d.seed)
    return Config(**vars(parser.parse_args(argv)))


def group_advantages(rewards: list[float]) -> list[float]:
    """Rewards normalised within their group; all zeros when the group's rewards are all equal."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards] if std > 0 else [0.0] * len(rewards)


def rl_feature(
    prompt: list[int], completion: list[int], logprobs: list[float], advantage: float
) -> dict[str, Any]:
    """A sampled completion as an InputFeature; the per-token arrays line up with input_ids."""
    return {
        "input_ids": prompt + completion,
        "labels": [IGNORE_INDEX] * len(prompt) + completion,
        "advantages": [0.0] * len(prompt) + [advantage] * len(completion),
        "old_logps": [0.0] * len(prompt) + list(logprobs),
    }


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    import random

    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import GSM8KProcessor, math_accuracy_reward
    from twinkle.preprocessor.gsm8k import DEFAULT_SYSTEM
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import Sampler

    client = init_twinkle_client(base_url=cfg.base_url, api_key=cfg.api_key)
    model_dir = cfg.model_dir or tokenizer_dir(cfg.base_url, cfg.api_key, cfg.base_model)

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

    model = MultiLoraTransformersModel(model_id=cfg.base_model)
    model.add_adapter_to_model(
        "default", {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "seed": cfg.seed}
    )
    model.set_loss("GRPOLoss")  # clip 0.8 / 1.2, no KL term by default (kl_beta=0.0)
    model.set_optimizer("AdamW", lr=cfg.learning_rate, weight_decay=0.0)
    sampler = Sampler(model_id=cfg.base_model)
    sampler.set_template("Qwen3_5Template", model_id=model_dir)  # to decode completions into text
    print(f"training LoRA adapter {model.training_run_id} on {cfg.base_model} with GRPOLoss")

    rng = random.Random(cfg.seed)
    params = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    for step in range(1, cfg.max_steps + 1):
        adapter_path = model.save(name=f"grpo-sampler-{step}", is_sampler=True)
        chosen = rng.sample(questions, min(cfg.questions_per_step, len(questions)))
        results = sampler.sample(
            [prompt for prompt, _ in chosen],
            sampling_params={**params, "seed": cfg.seed + step},
            adapter_path=adapter_path,
            num_samples=cfg.group_size,
        )
        assert isinstance(results, list)  # a list of prompts gives a list of results
        inputs, rewards = [], []
        for (prompt, truth), result in zip(chosen, results, strict=True):
            group = [math_accuracy_reward(sequence.text or "", truth) for sequence in result.sequences]
            rewards.extend(group)
            for sequence, advantage in zip(result.sequences, group_advantages(group), strict=True):
                if advantage != 0.0 and sequence.tokens:
                    inputs.append(rl_feature(prompt, sequence.tokens, sequence.logprobs or [], advantage))
        mean_reward = sum(rewards) / len(rewards)
        if not inputs:  # every group all right or all wrong: no signal, but the step still counts
            print(
                f"step {step}/{cfg.max_steps} reward {mean_reward:.3f} loss n/a (no group had mixed rewards)"
            )
            continue
        result = model.forward_backward(inputs=inputs)
        stepped = model.clip_grad_and_step()
        print(
            f"step {step}/{cfg.max_steps} reward {mean_reward:.3f} loss {result.loss:.4f} "
            f"grad_norm {stepped.grad_norm or 0.0:.3f} inputs {len(inputs)}",
            flush=True,
        )

    twinkle_path = model.save(name=f"grpo-step-{cfg.max_steps}", save_optimizer=True)
    print(f"Saved checkpoint: {twinkle_path}")
    client.close()


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
