"""Self-cognition SFT on a hosted Twinkle server with the Tinker SDK: self_host/self_cognition.py with hosted
defaults (Qwen/Qwen3.5-4B, the ms://swift/self-cognition dataset).

    TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/tinker/modelscope/self_cognition.py
"""

import os

from hosted import HOSTED_MODEL, run_hosted

if __name__ == "__main__":
    run_hosted(
        "self_cognition",
        base_model=HOSTED_MODEL,
        dataset=os.environ.get("TWINKLE_DATASET", "ms://swift/self-cognition"),
        learning_rate=1e-4,
    )
