"""GRPO on GSM8K on a hosted Twinkle server with the Tinker SDK: self_host/short_math_grpo.py with hosted
defaults (Qwen/Qwen3.5-4B, ms://modelscope/gsm8k subset main, longer completions).

    TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/tinker/modelscope/short_math_grpo.py
"""

import os

from hosted import HOSTED_MODEL, run_hosted

if __name__ == "__main__":
    run_hosted(
        "short_math_grpo",
        base_model=HOSTED_MODEL,
        dataset=os.environ.get("TWINKLE_DATASET", "ms://modelscope/gsm8k"),
        subset="main",
        max_tokens=512,
        group_size=8,
        learning_rate=1e-5,
    )
