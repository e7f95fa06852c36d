"""Multi-modal SFT with the Tinker SDK: LaTeX OCR, images sent as Tinker image chunks.

Each LaTeX-OCR row (an image of a formula and its LaTeX) becomes a chat whose user turn holds the image.
Twinkle's Template renders it with the vision model's processor, which expands the image into its
placeholder tokens and labels only the assistant's LaTeX; here each run of placeholders is replaced by a
`types.ImageChunk` carrying the PNG bytes (`expected_tokens` = the run's length), so the server sees the
image itself and the targets stay aligned with the expanded positions.

It needs a server serving a vision-language model: the e2e config serves the tiny LLaVA as `tiny-vl`
(`bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml` builds it as ./models/tiny-vl).

    bash cookbook/client/server/transformer/run.sh server_config_e2e.yaml   # another terminal
    python cookbook/client/tinker/self_host/multi_modal.py --max-steps 20

A server whose backend cannot train on images answers with a clear error; the example then stops at once,
printing that message, with exit status 3.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_client.example_connection import require_server, server_messages

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
SERVER_REFUSED = 3  # exit status when the server cannot train on images


@dataclass
class Config:
    base_url: str = os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    api_key: str = os.environ.get("TWINKLE_SERVER_TOKEN", "tml-cookbook")
    base_model: str = os.environ.get("TWINKLE_VL_BASE_MODEL", "tiny-vl")
    model_dir: str | None = os.environ.get("TWINKLE_VL_MODEL_DIR")
    dataset: str = os.environ.get("TWINKLE_VL_DATASET", str(DATA_DIR / "latex_ocr"))
    max_samples: int = 500
    max_steps: int = 20
    batch_size: int = 4
    rank: int = 16
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
    parser.add_argument(
        "--model-dir", default=d.model_dir, help="its processor, locally (env TWINKLE_VL_MODEL_DIR)"
    )
    parser.add_argument("--dataset", default=d.dataset, help="path or ms:// id (env TWINKLE_VL_DATASET)")
    parser.add_argument("--max-samples", type=int, default=d.max_samples)
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--rank", type=int, default=d.rank, help="LoRA rank")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    return Config(**vars(parser.parse_args(argv)))


def image_datum(feature: dict[str, Any], images: list[bytes], image_token_id: int) -> Any:
    """An encoded multi-modal InputFeature as a Datum whose image placeholders are image chunks."""
    from tinker import types

    from twinkle.data_format import IGNORE_INDEX

    input_ids = [int(token) for token in feature["input_ids"]]
    labels = [int(label) for label in feature["labels"]]
    tokens = input_ids[:-1]  # position t predicts token t+1
    chunks: list[Any] = []
    text: list[int] = []
    remaining = list(images)
    index = 0
    while index < len(tokens):
        if tokens[index] != image_token_id:
            text.append(tokens[index])
            index += 1
            continue
        run = index
        while run < len(tokens) and tokens[run] == image_token_id:
            run += 1
        if text:
            chunks.append(types.EncodedTextChunk(tokens=text))
            text = []
        chunks.append(types.ImageChunk(data=remaining.pop(0), format="png", expected_tokens=run - index))
        index = run
    if text:
        chunks.append(types.EncodedTextChunk(tokens=text))
    targets = labels[1:]
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={
            "target_tokens": [0 if label == IGNORE_INDEX else label for label in targets],
            "weights": [0.0 if label == IGNORE_INDEX else 1.0 for label in targets],
        },
    )


def main(argv: list[str] | None = None, defaults: Config | None = None) -> None:
    cfg = parse_args(argv, defaults)
    require_server(cfg.base_url)  # one line, not minutes of retries, when no server runs there
    from twinkle import init_tinker_client

    init_tinker_client()
    import tinker
    from tinker import types

    from twinkle.data_format import image_bytes
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import LatexOCRProcessor
    from twinkle.template import Template

    service = tinker.ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    training = service.create_lora_training_client(base_model=cfg.base_model, rank=cfg.rank).result()
    model_dir = cfg.model_dir or training.get_info().model_data.tokenizer_id or cfg.base_model
    print(f"training LoRA adapter {training.model_id} on {cfg.base_model}")

    dataset = Dataset(dataset_meta=DatasetMeta(cfg.dataset, data_slice=range(cfg.max_samples)))
    dataset.map(LatexOCRProcessor(), load_from_cache_file=False)  # images embedded as data: URIs
    template = Template(model_id=model_dir, max_length=1024)
    image_token_id = int(template.tokenizer.convert_tokens_to_ids(template.image_token))
    data = []
    for trajectory in dataset:
        images = [image_bytes(ref) for message in trajectory.messages for ref in message.images or []]
        data.append(image_datum(dict(template.encode(trajectory)), images, image_token_id))
    print(f"{len(data)} image/LaTeX pairs from {cfg.dataset}")

    adam = types.AdamParams(learning_rate=cfg.learning_rate)
    for step in range(1, cfg.max_steps + 1):
        start = (step - 1) * cfg.batch_size % len(data)
        batch = (data[start:] + data[:start])[: cfg.batch_size]
        try:
            result = training.forward_backward(batch, "cross_entropy").result()
        except (tinker.BadRequestError, tinker.RequestFailedError) as error:
            # A text-only backend says so plainly; there is nothing to retry, so stop with its message.
            print(f"the server cannot train on these images: {error}", file=sys.stderr)
            raise SystemExit(SERVER_REFUSED) from None
        training.optim_step(adam).result()
        weight = sum(float(sum(datum.loss_fn_inputs["weights"].tolist())) for datum in batch)
        print(f"step {step}/{cfg.max_steps} loss {result.metrics['loss:sum'] / weight:.4f}", flush=True)

    saved = training.save_state(f"latex-ocr-step-{cfg.max_steps}").result()
    print(f"Saved checkpoint to {saved.path}")


if __name__ == "__main__":
    with server_messages():  # a wrong model name or key: the server's message, not a traceback
        main()
