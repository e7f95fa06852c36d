"""LaTeX-OCR SFT on a hosted Twinkle server with the Twinkle client: self_host/multi_modal.py with hosted
defaults (Qwen/Qwen3.5-4B, the ms://AI-ModelScope/LaTeX_OCR dataset).

    TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/twinkle/modelscope/multi_modal.py
"""

import os
from dataclasses import replace

from hosted import HOSTED_MODEL, self_host_example, server_token, server_url

from twinkle.example_connection import server_messages

if __name__ == "__main__":
    with server_messages():
        example = self_host_example("multi_modal")
        example.main(
            defaults=replace(
                example.Config(),
                base_url=server_url(),
                api_key=server_token(),
                base_model=os.environ.get("TWINKLE_VL_BASE_MODEL", HOSTED_MODEL),
                dataset=os.environ.get("TWINKLE_VL_DATASET", "ms://AI-ModelScope/LaTeX_OCR"),
                learning_rate=1e-4,
            )
        )
