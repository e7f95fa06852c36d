"""The seed's Twinkle-client examples, driven only through `twinkle_client` against a launched server.

`seed_example` is the seed's complete training example as written; only the model (a tiny local one)
and the dataset (the repo's self-cognition sample) are swapped for local ones, since hubs are unreachable.
The tests skip, saying why, on a server without the Twinkle-native routes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.harness import LaunchedServer
from twinkle.data_format import Message, Trajectory
from twinkle_client import RequestFailed, init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import Sampler

pytestmark = pytest.mark.e2e
DATA = Path(__file__).resolve().parents[2] / "cookbook" / "data" / "self_cognition.jsonl"


@pytest.fixture(scope="module")
def server(mock_server: LaunchedServer) -> LaunchedServer:
    probe = httpx.get(mock_server.api + "/twinkle/capacity_info", headers={"X-API-Key": "probe"}, timeout=30)
    if probe.status_code == 404:
        pytest.skip(
            "The server has no Twinkle-native routes (GET /api/v1/twinkle/capacity_info answers 404)."
        )
    return mock_server


def seed_example(
    base_url: str, api_key: str, base_model: str, *, resume: bool, remote_data: bool = False, epochs: int = 3
) -> dict[str, Any]:
    """The seed's example; `seen` collects what the example logs, for the assertions."""
    from peft import LoraConfig

    from twinkle import get_logger
    from twinkle.dataset import DatasetMeta

    if remote_data:
        from twinkle_client.dataloader import DataLoader
        from twinkle_client.dataset import Dataset
    else:
        from twinkle.dataloader import DataLoader
        from twinkle.dataset import Dataset

    logger = get_logger()
    seen: dict[str, Any] = {"models": [], "checkpoints": [], "metrics": [], "saved": []}

    # Step 1
    client = init_twinkle_client(base_url=base_url, api_key=api_key)
    print("Available models:")
    for item in client.get_server_capabilities().supported_models:
        print("- " + item.model_name)
        seen["models"].append(item.model_name)

    # Step 2
    runs = client.list_training_runs()
    resume_path = None
    for run in runs:
        logger.info(run.model_dump_json(indent=2))
        checkpoints = client.list_checkpoints(run.training_run_id)
        for checkpoint in checkpoints:
            logger.info(checkpoint.model_dump_json(indent=2))
            seen["checkpoints"].append(checkpoint.twinkle_path)
            if resume:
                resume_path = checkpoint.twinkle_path

    # Step 3
    dataset = Dataset(dataset_meta=DatasetMeta(str(DATA), data_slice=range(500)))
    dataset.set_template("Qwen3_5Template", model_id=base_model, max_length=512)
    dataset.map(
        "SelfCognitionProcessor", init_args={"model_name": "twinkle模型", "model_author": "ModelScope社区"}
    )
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=4)
    seen["dataset"] = dataset

    # Step 4
    model = MultiLoraTransformersModel(model_id=base_model)
    lora_config = LoraConfig(target_modules="all-linear")
    model.add_adapter_to_model("default", lora_config, gradient_accumulation_steps=2)
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("Adam", lr=1e-4)

    # Step 5
    start_step = 0
    if resume_path:
        logger.info(f"Resuming from checkpoint {resume_path}")
        progress = model.resume_from_checkpoint(resume_path)
        dataloader.resume_from_checkpoint(progress["consumed_train_samples"])
        start_step = progress["cur_step"]
        seen["resumed_from"], seen["progress"] = resume_path, progress

    # Step 6
    logger.info(model.get_train_configs().model_dump())
    for epoch in range(epochs):
        logger.info(f"Starting epoch {epoch}")
        for cur_step, batch in enumerate(dataloader, start=start_step + 1):
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            if cur_step % 2 == 0:
                metric = model.calculate_metric(is_training=True)
                logger.info(f"Current is step {cur_step} of {len(dataloader)}, metric: {metric.result}")
                seen["metrics"].append(metric.result)

        # Step 7
        twinkle_path = model.save(
            name=f"twinkle-epoch-{epoch}",
            save_optimizer=True,
            consumed_train_samples=dataloader.get_state()["consumed_train_samples"],
        )
        logger.info(f"Saved checkpoint: {twinkle_path}")
        seen["saved"].append(twinkle_path)

    seen["run_id"], seen["client"], seen["model"] = model.training_run_id, client, model
    seen["consumed"] = dataloader.get_state()["consumed_train_samples"]
    return seen


def test_the_seed_example_trains_saves_per_epoch_and_resumes_from_the_listed_checkpoint(
    server: LaunchedServer, tiny_model_dir: Path
) -> None:
    base_model = str(tiny_model_dir)
    first = seed_example(server.base_url, "tml-client-seed", base_model, resume=False)
    client = first["client"]
    try:
        assert first["models"] == ["tiny-qwen"] and first["checkpoints"] == []
        rows = len(first["dataset"])
        assert rows == sum(1 for _ in DATA.open()) and first["consumed"] == 3 * rows
        assert first["saved"] == [f"twinkle://{first['run_id']}/weights/twinkle-epoch-{e}" for e in range(3)]
        assert [c.twinkle_path for c in client.list_checkpoints(first["run_id"])] == first["saved"]
        assert client.get_latest_checkpoint_path(first["run_id"]) == first["saved"][-1]
        assert first["metrics"] and all(m["loss"] > 0 for m in first["metrics"])
        micro_batches = 3 * -(-rows // 4)
        config = first["model"].get_train_configs().model_dump()
        assert config["gradient_accumulation_steps"] == 2 and config["loss"] == "CrossEntropyLoss"
    finally:
        client.close()

    resumed = seed_example(server.base_url, "tml-client-seed", base_model, resume=True, epochs=1)
    try:
        assert resumed["resumed_from"] == first["saved"][-1]
        assert resumed["progress"] == {
            "cur_step": micro_batches // 2,
            "consumed_train_samples": 3 * rows,
            "gradient_accumulation_steps": 2,
        }
        assert resumed["consumed"] == 4 * rows  # the dataloader went on with the fourth epoch
    finally:
        resumed["client"].close()


def test_the_seed_example_runs_with_the_remote_dataset_and_encodes_like_the_local_one(
    server: LaunchedServer, tiny_model_dir: Path
) -> None:
    from twinkle.dataset import Dataset, DatasetMeta

    seen = seed_example(
        server.base_url, "tml-client-remote", str(tiny_model_dir), resume=False, remote_data=True, epochs=1
    )
    try:
        remote = seen["dataset"]
        local = Dataset(DatasetMeta(str(DATA)))
        local.set_template("Qwen3_5Template", model_id=str(tiny_model_dir), max_length=512)
        local.map(
            "SelfCognitionProcessor",
            init_args={"model_name": "twinkle模型", "model_author": "ModelScope社区"},
        )
        local.encode(batched=True)
        assert len(remote) == len(local)
        for index in (0, len(local) // 2, len(local) - 1):
            assert np.array_equal(remote[index]["input_ids"], local[index]["input_ids"])
            assert np.array_equal(remote[index]["labels"], local[index]["labels"])
        assert len(seen["saved"]) == 1 and seen["metrics"]
    finally:
        seen["client"].close()


def test_a_saved_adapter_is_sampled_with_a_template(server: LaunchedServer, tiny_model_dir: Path) -> None:
    with init_twinkle_client(server.base_url, "tml-client-sample"):
        model = MultiLoraTransformersModel(str(tiny_model_dir))
        model.add_adapter_to_model("default", {"r": 4})
        model.set_optimizer("Adam", lr=1e-3)
        batch = [{"input_ids": np.arange(5, 25), "labels": np.arange(5, 25)}]
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        sampler_path = model.save("for-sampling", is_sampler=True)
        training_path = model.save("training")

        sampler = Sampler(str(tiny_model_dir))
        sampler.set_template("Qwen3_5Template", model_id=str(tiny_model_dir))
        prompt = Trajectory(
            messages=[Message("system", "You are a helpful assistant"), Message("user", "你是谁？")]
        )
        result = sampler.sample(
            prompt,
            sampling_params={"max_tokens": 8, "temperature": 0.7, "seed": 1},
            adapter_path=sampler_path,
            num_samples=2,
        )
        assert len(result.sequences) == 2
        for sequence in result.sequences:
            assert 1 <= len(sequence.tokens) <= 8 and isinstance(sequence.text, str)
            assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens)

        several = sampler.sample(
            [[5, 6, 7], [8, 9]], sampling_params={"max_tokens": 3}, adapter_path=training_path
        )
        assert len(several) == 2
        assert sampler.sample([5, 6, 7], sampling_params={"max_tokens": 2}).sequences  # the base model


def test_management_calls_and_errors_through_the_client(server: LaunchedServer, tiny_model_dir: Path) -> None:
    with init_twinkle_client(server.base_url, "tml-client-admin") as client:
        assert client.health_check()
        model = MultiLoraTransformersModel(f"ms://{tiny_model_dir.name}")
        run_id = model.add_adapter_to_model("default", {"r": 4})
        capacity = client.get_capacity_info().models[0]
        assert capacity.model_name == "tiny-qwen" and capacity.used_loras >= 1
        with pytest.raises(RequestFailed, match="CrossEntropyLoss") as caught:
            model.set_loss("os.system")
        assert caught.value.category == "user"
        path = model.save("to-delete")
        assert client.get_checkpoint_path(run_id, "to-delete") == path
        assert client.get_weights_info(path).lora_rank == 4
        assert [r.training_run_id for r in client.list_training_runs()] == [run_id]
        client.delete_checkpoint(run_id, "weights/to-delete")
        assert client.get_latest_checkpoint_path(run_id) is None
