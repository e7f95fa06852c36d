from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tests.client.fake_server import FakeTwinkleServer
from twinkle.data_format import Message, Trajectory
from twinkle_client import InvalidArgument, RequestFailed, TwinkleClient, TwinkleFuture
from twinkle_client.model import MultiLoraTransformersModel, lora_config_body


@dataclasses.dataclass
class LoraConfigLike:
    """The fields of peft.LoraConfig the client reads, with peft's defaults (peft itself imports torch)."""

    r: int = 8
    lora_alpha: int = 8
    target_modules: Any = None
    lora_dropout: float = 0.0
    use_dora: bool = False
    task_type: str | None = None


def feature(offset: int = 0) -> dict[str, Any]:
    ids = np.arange(6, dtype=np.int64) + offset
    return {
        "input_ids": ids,
        "labels": np.array([-100, -100, -100, 3, 4, 5], dtype=np.int64),
        "attention_mask": np.ones(6, dtype=np.int64),
        "advantages": np.float32(0.5),
        "old_logps": np.array([-1.0, -2.0], dtype=np.float32),
        "pixel_values": np.zeros((2, 3), np.float32),
    }


@pytest.fixture
def model(client: TwinkleClient) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel("ms://Qwen/Qwen3.5-4B")
    model.add_adapter_to_model("default", {"r": 4}, gradient_accumulation_steps=2)
    return model


def test_peft_lora_configs_map_to_the_servers_names() -> None:
    config = LoraConfigLike(r=16, lora_alpha=32, target_modules={"v_proj", "q_proj"}, lora_dropout=0.05)
    assert lora_config_body(config) == {
        "rank": 16,
        "alpha": 32,
        "target_modules": ["q_proj", "v_proj"],
        "dropout": 0.05,
    }
    assert lora_config_body(LoraConfigLike(target_modules="all-linear"))["target_modules"] == "all-linear"
    assert lora_config_body({"rank": 4, "alpha": 8, "train_unembed": False}) == {
        "rank": 4,
        "alpha": 8,
        "train_unembed": False,
    }


def test_peft_options_the_server_does_not_use_are_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lora_config_body(LoraConfigLike(use_dora=True, task_type="CAUSAL_LM"))
    assert "ignored: use_dora." in caplog.text


def test_unknown_lora_options_and_types_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="Unknown LoRA option 'rnak'"):
        lora_config_body({"rnak": 4})
    with pytest.raises(InvalidArgument, match=r"peft\.LoraConfig"):
        lora_config_body(8)


def test_methods_before_add_adapter_say_to_add_one(client: TwinkleClient) -> None:
    model = MultiLoraTransformersModel("Qwen/Qwen3.5-4B")
    with pytest.raises(InvalidArgument, match="add_adapter_to_model"):
        model.set_loss("CrossEntropyLoss")


def test_a_second_adapter_on_one_model_object_is_refused(model: MultiLoraTransformersModel) -> None:
    with pytest.raises(InvalidArgument, match="another MultiLoraTransformersModel"):
        model.add_adapter_to_model("other", {"r": 4})


def test_set_methods_return_the_servers_train_config(
    model: MultiLoraTransformersModel, server: FakeTwinkleServer
) -> None:
    model.set_optimizer("default", lr=1e-4)
    config = model.set_lr_scheduler("default", lr_decay_steps=1000, max_lr=1e-4)
    assert config.model_dump()["lr_scheduler_kwargs"] == {"lr_decay_steps": 1000, "max_lr": 1e-4}
    assert model.get_train_configs().model_dump()["optimizer"] == "default"
    assert model.set_loss(type("GRPOLoss", (), {})).model_dump()["loss"] == "GRPOLoss"  # a class, by its name


def test_numpy_inputs_travel_as_lists_and_arrays_of_two_dimensions_as_npy(
    model: MultiLoraTransformersModel, server: FakeTwinkleServer
) -> None:
    result = model.forward_backward(inputs=[feature(), feature(1)], beta=0.1)
    sent = server.sent("/twinkle/forward_backward")[0].body
    item = sent["inputs"][0]
    assert item["input_ids"] == [0, 1, 2, 3, 4, 5] and item["labels"] == [-100, -100, -100, 3, 4, 5]
    assert item["advantages"] == 0.5 and item["old_logps"] == [-1.0, -2.0]
    assert set(item["pixel_values"]) == {"npy"}
    assert sent["loss_kwargs"] == {"beta": 0.1}
    assert result.loss == 2.0 and len(result.logprobs) == 2 and result.metrics["tokens"] == 6


def test_trajectories_are_sent_as_messages(
    model: MultiLoraTransformersModel, server: FakeTwinkleServer
) -> None:
    trajectory = Trajectory(messages=[Message("user", "hi"), Message("assistant", "hello")])
    with pytest.raises(RequestFailed, match="need a template"):
        model.forward_only(inputs=[trajectory])
    model.set_template("Qwen3_5Template")
    assert model.forward_only(inputs=trajectory, disable_lora=True).loss == 2.0
    sent = server.sent("/twinkle/forward_only")[-1].body
    assert sent["disable_lora"] is True
    assert sent["inputs"][0]["messages"][1] == {"role": "assistant", "content": "hello", "images": None}


def test_inputs_that_are_neither_features_nor_trajectories_are_refused(
    model: MultiLoraTransformersModel,
) -> None:
    with pytest.raises(InvalidArgument, match="neither input_ids nor messages"):
        model.forward_backward(inputs=[{"text": "hi"}])
    with pytest.raises(InvalidArgument, match="empty"):
        model.forward_backward(inputs=[])


def test_gradient_accumulation_steps_the_optimizer_every_second_call(
    model: MultiLoraTransformersModel,
) -> None:
    steps = []
    for index in range(4):
        model.forward_backward(inputs=[feature(index)])
        steps.append(model.clip_grad_and_step(max_grad_norm=1.0))
    assert [s.stepped for s in steps] == [False, True, False, True]
    assert steps[-1].cur_step == 2 and steps[1].grad_norm == 1.5
    metric = model.calculate_metric(is_training=True)
    assert metric.result["cur_step"] == 2 and metric.result["tokens"] == 12


def test_submit_twins_pipeline_calls_in_submission_order(
    model: MultiLoraTransformersModel, server: FakeTwinkleServer
) -> None:
    futures: list[TwinkleFuture[Any]] = []
    for index in range(3):
        futures.append(model.submit_forward_backward(inputs=[feature(index)]))
        futures.append(model.submit_clip_grad_and_step())
    results = [future.result(timeout=5) for future in futures]
    assert [r.cur_step for r in results[1::2]] == [0, 1, 1]
    submitted = [r.path.rsplit("/", 1)[-1] for r in server.requests if "/twinkle/" in r.path][-6:]
    assert submitted == ["forward_backward", "clip_grad_and_step"] * 3


def test_add_adapter_can_be_submitted_and_later_calls_wait_for_it(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    model = MultiLoraTransformersModel("Qwen/Qwen3.5-4B")
    future = model.submit_add_adapter_to_model("default", {"r": 4}, gradient_accumulation_steps=3)
    model.set_loss("CrossEntropyLoss")
    assert future.done() and model.training_run_id == future.result()
    assert server.run(model.training_run_id).config["gradient_accumulation_steps"] == 3


def test_save_resume_and_upload_use_twinkle_paths(
    model: MultiLoraTransformersModel, client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    path = model.save("ckpt", save_optimizer=True, consumed_train_samples=12)
    assert path == f"twinkle://{model.training_run_id}/weights/ckpt"
    sampler_path = model.save("for-sampling", is_sampler=True)
    assert sampler_path.endswith("/sampler_weights/for-sampling")
    assert server.sent("/twinkle/save")[-1].body["save_optimizer"] is False
    assert client.get_latest_checkpoint_path(model.training_run_id, "sampler") == sampler_path

    other = MultiLoraTransformersModel("Qwen/Qwen3.5-4B")
    other.add_adapter_to_model("default", {"r": 4})
    assert other.resume_from_checkpoint(path) == {
        "cur_step": 0,
        "consumed_train_samples": 12,
        "gradient_accumulation_steps": 2,
    }

    upload = model.upload_to_hub(
        checkpoint_dir=path, hub_model_id="me/twinkle-self-cognition", async_upload=False
    )
    assert upload.hub_model_id == "me/twinkle-self-cognition"
    pending = model.upload_to_hub(
        checkpoint_dir=path, hub_model_id="me/again", hub_token="t", async_upload=True
    )
    assert isinstance(pending, TwinkleFuture) and pending.result(timeout=5).hub_model_id == "me/again"
    assert server.sent("/twinkle/upload_to_hub")[-1].body["hub_token"] == "t"


def test_unload_frees_the_adapter_slot(model: MultiLoraTransformersModel, client: TwinkleClient) -> None:
    assert client.get_capacity_info().models[0].used_loras == 1
    model.unload()
    assert client.get_capacity_info().models[0].used_loras == 0
