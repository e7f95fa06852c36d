"""LaTeX-OCR SFT on a hosted Twinkle server with the Twinkle client: self_host/multi_modal.py with hosted
defaults (Qwen/Qwen3.5-4B, the ms://AI-ModelScope/LaTeX_OCR dataset).

    TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/twinkle/modelscope/multi_modal.py
"""

import os

from hosted import HOSTED_MODEL, run_hosted

if __name__ == "__main__":
    run_hosted(
        "multi_modal",
        base_model=os.environ.get("TWINKLE_VL_BASE_MODEL", HOSTED_MODEL),
        dataset=os.environ.get("TWINKLE_VL_DATASET", "ms://AI-ModelScope/LaTeX_OCR"),
        learning_rate=1e-4,
    )
