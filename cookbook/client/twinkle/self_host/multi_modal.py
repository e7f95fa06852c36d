"""Multi-modal SFT with the Twinkle client: LaTeX OCR from trajectories that carry their images.

Each LaTeX-OCR row becomes a Trajectory whose user message holds the image (embedded as a data: URI by
LatexOCRProcessor, so it travels with the request) and whose assistant message is the LaTeX. The
trajectories go to the server as they are: it encodes them with the vision model's processor (image
placeholder tokens, pixel values) and trains the adapter on the LaTeX tokens only.

It needs a server serving a vision-language model: the e2e config serves the tiny LLaVA as `tiny-vl`
(`bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml` builds it as ./models/tiny-vl).

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/twinkle/self_host/multi_modal.py --max-steps 20

A server whose backend cannot train on images answers with a clear error; the example then stops at once,
printing that message, with exit status 3.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from twinkle_client.example_connection import require_server, server_messages

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
SERVER_REFUSED = 3  # exit status when the server cannot train on images


@dataclass
class Config:
    base_url: str = os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    api_key: str = os.environ.get("TWINKLE_SERVER_TOKEN", "tml-cookbook")
    base_model: str = os.environ.get("TWINKLE_VL_BASE_MODEL", "tiny-vl")
    dataset: str = os.environ.get("TWINKLE_VL_DATASET", str(DATA_DIR / "latex_ocr"))
    template: str = "Qwen3_5Template"
    max_samples: int = 500
    max_steps: int = 20
    batch_size: int = 4
    learning_rate: float = 5e-3  # for the tiny random model; real models train well around 1e-4


def parse_args(argv: list[str] | None = None, defaults: Config | None = None) -> Config:
    d = defaults or Config()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=d.base_url, help="server address (env TWINKLE_SERVER_URL)")
    parser.add_argument("--api-key", default=d.api_key, help="API key (env TWINKLE_SERVER_TOKEN)")
    parser.add_argument(
        "--base-model", default=d.base_model, help="served vision model (env TWINKLE_VL_BASE_MODEL)"
    )
    parser.add_argument("--dataset", default=d.dataset, help="path or ms:// id (env TWINKLE_VL_DATASET)")
    parser.add_argument(
        "--template", default=d.template, help="the server-side template that encodes the images"
    )
    parser.add_argument("--max-samples", type=int, default=d.max_samples)
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    return Config(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import LatexOCRProcessor
    from twinkle_client import RequestFailed, init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel

    client = init_twinkle_client(base_url=cfg.base_url, api_key=cfg.api_key)
    dataset = Dataset(dataset_meta=DatasetMeta(cfg.dataset, data_slice=range(cfg.max_samples)))
    dataset.map(LatexOCRProcessor(), load_from_cache_file=False)
    dataloader = DataLoader(dataset=dataset, batch_size=cfg.batch_size, shuffle=True)
    print(f"{len(dataset)} image/LaTeX pairs from {cfg.dataset}")

    model = MultiLoraTransformersModel(model_id=cfg.base_model)
    model.add_adapter_to_model("default", {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
    model.set_template(cfg.template)
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=cfg.learning_rate)
    print(f"training LoRA adapter {model.training_run_id} on {cfg.base_model}")

    step = 0
    while step < cfg.max_steps:
        for batch in dataloader:
            step += 1
            try:
                result = model.forward_backward(inputs=batch)
            except RequestFailed as error:
                # A text-only backend says so plainly; there is nothing to retry, so stop with its message.
                print(f"the server cannot train on these images: {error}", file=sys.stderr)
                raise SystemExit(SERVER_REFUSED) from None
            stepped = model.clip_grad_and_step()
            print(
                f"step {step}/{cfg.max_steps} loss {result.loss:.4f} grad_norm {stepped.grad_norm or 0.0:.3f}"
            )
            if step >= cfg.max_steps:
                break

    twinkle_path = model.save(name=f"latex-ocr-step-{step}", save_optimizer=True)
    print(f"Saved checkpoint: {twinkle_path}")
    client.close()


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
