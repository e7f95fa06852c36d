"""DPO on a hosted Twinkle server with the Twinkle client: self_host/dpo.py with hosted defaults.

TWINKLE_SERVER_URL=... MODELSCOPE_TOKEN=... python cookbook/client/twinkle/modelscope/dpo.py --max-steps 20
"""

import os

from hosted import HOSTED_MODEL, run_hosted

if __name__ == "__main__":
    run_hosted(
        "dpo",
        base_model=HOSTED_MODEL,
        dataset=os.environ.get("TWINKLE_DATASET", "ms://hjh0119/shareAI-Llama3-DPO-zh-en-emoji"),
        learning_rate=5e-6,
    )
