"""The seed's complete Twinkle-client training example (Transformers backend), against the fake server.

`train_like_the_seed` is the seed's code with the data swapped for in-memory features (the e2e suite runs
it on real data against a launched server) and the LoRA config as a dict (importing peft takes longer
than this whole suite). Everything else is as written in the docs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.client.fake_server import FakeTwinkleServer
from twinkle import get_logger
from twinkle.dataloader import DataLoader
from twinkle_client import RetryPolicy, init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel

BASE_MODEL = "Qwen/Qwen3.5-4B"
REPO = Path(__file__).resolve().parents[2]


def features(count: int) -> list[dict[str, Any]]:
    rows = []
    for index in range(count):
        ids = np.arange(10, dtype=np.int64) + index
        labels = np.where(np.arange(10) < 6, -100, ids).astype(np.int64)
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": np.ones(10, dtype=np.int64)})
    return rows


def train_like_the_seed(
    server: FakeTwinkleServer, dataset: Any, resume: bool, epochs: int = 3, batch_size: int = 4
) -> dict[str, Any]:
    logger = get_logger()
    seen: dict[str, Any] = {"metrics": [], "saved": [], "models": [], "steps": []}

    client = init_twinkle_client(
        base_url="http://localhost:8000",
        api_key=server.api_key,
        transport=server.transport(),
        retry=RetryPolicy(sleep=lambda _: None),
    )
    for item in client.get_server_capabilities().supported_models:
        seen["models"].append(item.model_name)

    runs = client.list_training_runs()
    resume_path = None
    for run in runs:
        logger.info(run.model_dump_json(indent=2))
        checkpoints = client.list_checkpoints(run.training_run_id)
        for checkpoint in checkpoints:
            logger.info(checkpoint.model_dump_json(indent=2))
            if resume:
                resume_path = checkpoint.twinkle_path

    dataloader = DataLoader(dataset=dataset, batch_size=batch_size)

    model = MultiLoraTransformersModel(model_id=f"ms://{BASE_MODEL}")
    lora_config = {"target_modules": "all-linear"}
    model.add_adapter_to_model("default", lora_config, gradient_accumulation_steps=2)
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("Adam", lr=1e-4)

    start_step = 0
    if resume_path:
        logger.info(f"Resuming from checkpoint {resume_path}")
        progress = model.resume_from_checkpoint(resume_path)
        dataloader.resume_from_checkpoint(progress["consumed_train_samples"])
        start_step = progress["cur_step"]
        seen["progress"] = progress

    logger.info(model.get_train_configs().model_dump())
    for epoch in range(epochs):
        logger.info(f"Starting epoch {epoch}")
        for cur_step, batch in enumerate(dataloader, start=start_step + 1):
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            seen["steps"].append(cur_step)
            if cur_step % 2 == 0:
                metric = model.calculate_metric(is_training=True)
                logger.info(f"Current is step {cur_step} of {len(dataloader)}, metric: {metric.result}")
                seen["metrics"].append(metric.result)
        twinkle_path = model.save(
            name=f"twinkle-epoch-{epoch}",
            save_optimizer=True,
            consumed_train_samples=dataloader.get_state()["consumed_train_samples"],
        )
        logger.info(f"Saved checkpoint: {twinkle_path}")
        seen["saved"].append(twinkle_path)
    seen["run_id"] = model.training_run_id
    client.close()
    return seen


def test_the_seed_example_trains_with_accumulation_metrics_and_a_checkpoint_per_epoch(
    server: FakeTwinkleServer,
) -> None:
    seen = train_like_the_seed(server, features(8), resume=False, epochs=2)

    run = server.run(seen["run_id"])
    assert seen["models"] == [BASE_MODEL]
    assert run.base_model == BASE_MODEL and run.lora == {"target_modules": "all-linear"}
    assert run.config["gradient_accumulation_steps"] == 2
    assert run.config["template"] == "Qwen3_5Template"
    assert run.config["processor_kwargs"] == {"padding_side": "right"}
    assert run.config["optimizer"] == "Adam" and run.config["optimizer_kwargs"] == {"lr": 1e-4}
    # 2 epochs x 2 batches = 4 micro-batches; accumulation over 2 makes 2 optimizer steps.
    assert len(server.sent("/twinkle/forward_backward")) == 4
    assert len(server.sent("/twinkle/clip_grad_and_step")) == 4
    assert run.cur_step == 2
    assert len(seen["metrics"]) == 2 and all(m["loss"] is not None for m in seen["metrics"])
    assert seen["saved"] == [f"twinkle://{seen['run_id']}/weights/twinkle-epoch-{e}" for e in range(2)]
    assert [p["consumed_train_samples"] for p in run.progress.values()] == [8, 16]
    first_batch = run.received_inputs[0]
    assert len(first_batch) == 4
    assert first_batch[0]["input_ids"] == list(range(10))
    assert first_batch[0]["labels"] == [-100] * 6 + [6, 7, 8, 9]


def test_the_seed_example_resumes_from_the_listed_checkpoint_and_skips_consumed_samples(
    server: FakeTwinkleServer, caplog: pytest.LogCaptureFixture
) -> None:
    train_like_the_seed(server, features(8), resume=False, epochs=1)
    first_run = server.run()
    first_run.progress["weights/twinkle-epoch-0"]["consumed_train_samples"] = 4  # as if stopped mid-epoch

    with caplog.at_level(logging.INFO, logger="twinkle"):
        seen = train_like_the_seed(server, features(8), resume=True, epochs=1)

    assert seen["progress"] == {"cur_step": 1, "consumed_train_samples": 4, "gradient_accumulation_steps": 2}
    assert seen["steps"] == [2]  # one batch left in the epoch, numbered after the resumed step
    resumed = server.run(seen["run_id"])
    assert [item["input_ids"][0] for item in resumed.received_inputs[0]] == [4, 5, 6, 7]
    assert f"Resuming from checkpoint twinkle://{first_run.run_id}/weights/twinkle-epoch-0" in caplog.text
    assert '"twinkle_path"' in caplog.text  # the checkpoints were logged as JSON


def test_the_seed_example_runs_with_the_remote_dataset_and_dataloader(server: FakeTwinkleServer) -> None:
    from twinkle.dataset import DatasetMeta
    from twinkle_client.dataloader import DataLoader as RemoteDataLoader
    from twinkle_client.dataset import Dataset

    client = init_twinkle_client("http://localhost:8000", server.api_key, transport=server.transport())
    dataset = Dataset(
        dataset_meta=DatasetMeta(str(REPO / "cookbook/data/self_cognition.jsonl"), data_slice=range(12))
    )
    dataset.set_template("Qwen3_5Template", model_id=f"ms://{BASE_MODEL}", max_length=512)
    dataset.map(
        "SelfCognitionProcessor", init_args={"model_name": "twinkle模型", "model_author": "ModelScope社区"}
    )
    dataset.encode(batched=True, num_proc=2)
    client.close()

    assert RemoteDataLoader is DataLoader
    assert len(dataset) == 12 and dataset.kind == "feature"
    encode_calls = server.sent("/twinkle/encode")
    assert len(encode_calls) > 1
    assert encode_calls[0].body["template_kwargs"] == {"model_id": f"ms://{BASE_MODEL}", "max_length": 512}
    assert "twinkle模型" in encode_calls[0].body["rows"][0]["messages"][-1]["content"]

    seen = train_like_the_seed(server, dataset, resume=False, epochs=1)
    assert seen["saved"] and len(server.run(seen["run_id"]).received_inputs) == 3
