"""DPO on a hosted Twinkle server with the Twinkle client: self_host/dpo.py with hosted defaults.

TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/twinkle/modelscope/dpo.py --max-steps 20
"""

import os
from dataclasses import replace

from hosted import HOSTED_MODEL, self_host_example, server_token, server_url

from twinkle.example_connection import server_messages

if __name__ == "__main__":
    with server_messages():
        example = self_host_example("dpo")
        example.main(
            defaults=replace(
                example.Config(),
                base_url=server_url(),
                api_key=server_token(),
                base_model=HOSTED_MODEL,
                dataset=os.environ.get("TWINKLE_DATASET", "ms://hjh0119/shareAI-Llama3-DPO-zh-en-emoji"),
                learning_rate=5e-6,
            )
        )
