"""Self-cognition SFT on a hosted Twinkle server with the Twinkle client: self_host/self_cognition.py with
hosted defaults (Qwen/Qwen3.5-4B, the ms://swift/self-cognition dataset).

    TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/twinkle/modelscope/self_cognition.py
"""

import os
from dataclasses import replace

from hosted import HOSTED_MODEL, self_host_example, server_token, server_url

from twinkle.example_connection import server_messages

if __name__ == "__main__":
    with server_messages():
        example = self_host_example("self_cognition")
        example.main(
            defaults=replace(
                example.Config(),
                base_url=server_url(),
                api_key=server_token(),
                base_model=HOSTED_MODEL,
                dataset=os.environ.get("TWINKLE_DATASET", "ms://swift/self-cognition"),
                learning_rate=1e-4,
            )
        )
