from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.client.fake_server import FakeTwinkleServer
from twinkle_client import InvalidArgument, NotFoundError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel


def trained_run(client: TwinkleClient, *names: str) -> str:
    model = MultiLoraTransformersModel("Qwen/Qwen3.5-4B", client=client)
    run_id = model.add_adapter_to_model("default", {"r": 8, "lora_alpha": 16})
    for name in names:
        model.save(name, consumed_train_samples=4)
    return run_id


def test_health_check_is_true_for_a_healthy_server_and_false_for_an_answer_that_is_not_ok(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    assert client.health_check() is True
    server.inject("GET", "/healthz", status=503)
    assert client.health_check() is False


def test_capabilities_and_capacity_are_pydantic_models(client: TwinkleClient) -> None:
    capabilities = client.get_server_capabilities()
    assert [m.model_name for m in capabilities.supported_models] == ["Qwen/Qwen3.5-4B"]
    assert (
        json.loads(capabilities.model_dump_json(indent=2))["supported_models"][0]["max_context_length"]
        == 2048
    )
    trained_run(client)
    capacity = client.get_capacity_info().models[0]
    assert (capacity.max_loras, capacity.used_loras, capacity.free_loras) == (4, 1, 3)


def test_training_runs_and_checkpoints_are_listed_with_twinkle_paths(client: TwinkleClient) -> None:
    run_id = trained_run(client, "first", "second")
    runs = client.list_training_runs(limit=20)
    assert [r.training_run_id for r in runs] == [run_id]
    assert runs[0].lora_rank == 8 and runs[0].user_metadata == {"adapter_name": "default"}
    assert client.get_training_run(run_id).last_checkpoint is not None
    checkpoints = client.list_checkpoints(run_id)
    assert [c.checkpoint_id for c in checkpoints] == ["weights/first", "weights/second"]
    dumped = json.loads(checkpoints[0].model_dump_json(indent=2))
    assert dumped["twinkle_path"] == f"twinkle://{run_id}/weights/first"
    assert dumped["tinker_path"] == f"tinker://{run_id}/weights/first"


def test_list_training_runs_pages_with_limit_and_offset(client: TwinkleClient) -> None:
    ids = [trained_run(client) for _ in range(3)]
    assert [r.training_run_id for r in client.list_training_runs(limit=2)] == ids[:2]
    assert [r.training_run_id for r in client.list_training_runs(limit=2, offset=2)] == ids[2:]


def test_checkpoint_paths_are_found_by_id_or_name_and_the_latest_by_time(client: TwinkleClient) -> None:
    run_id = trained_run(client, "a", "b")
    assert client.get_checkpoint_path(run_id, "weights/a") == f"twinkle://{run_id}/weights/a"
    assert client.get_checkpoint_path(run_id, "b") == f"twinkle://{run_id}/weights/b"
    assert client.get_latest_checkpoint_path(run_id) == f"twinkle://{run_id}/weights/b"
    with pytest.raises(NotFoundError, match=r"no checkpoint 'c'\. Its checkpoints: weights/a, weights/b"):
        client.get_checkpoint_path(run_id, "c")


def test_a_run_without_checkpoints_has_no_latest_path(client: TwinkleClient) -> None:
    assert client.get_latest_checkpoint_path(trained_run(client)) is None


def test_deleting_a_checkpoint_removes_it_from_the_listing(client: TwinkleClient) -> None:
    run_id = trained_run(client, "a", "b")
    client.delete_checkpoint(run_id, "weights/a")
    assert [c.checkpoint_id for c in client.list_checkpoints(run_id)] == ["weights/b"]
    with pytest.raises(NotFoundError):
        client.delete_checkpoint(run_id, "weights/a")


def test_weights_info_takes_a_twinkle_path(client: TwinkleClient) -> None:
    run_id = trained_run(client, "a")
    info = client.get_weights_info(f"twinkle://{run_id}/weights/a")
    assert info.base_model == "Qwen/Qwen3.5-4B" and info.lora_rank == 8


@pytest.mark.parametrize(
    "model_id", ["ms://Qwen/Qwen3.5-4B", "hf://Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-4B", "Qwen3.5-4B"]
)
def test_model_ids_map_to_the_served_name(client: TwinkleClient, model_id: str) -> None:
    assert client.served_model(model_id).model_name == "Qwen/Qwen3.5-4B"


def test_a_local_model_directory_maps_to_its_basename(tmp_path: Path) -> None:
    server = FakeTwinkleServer(models=("tiny-qwen",))
    model_dir = tmp_path / "models" / "tiny-qwen"
    model_dir.mkdir(parents=True)
    with TwinkleClient("http://t", server.api_key, transport=server.transport()) as client:
        assert client.served_model(str(model_dir) + "/").model_name == "tiny-qwen"


def test_a_model_the_server_does_not_serve_is_refused_listing_the_served_ones(client: TwinkleClient) -> None:
    with pytest.raises(
        InvalidArgument, match=r"does not serve 'ms://Org/Other'. Served models: Qwen/Qwen3.5-4B"
    ):
        MultiLoraTransformersModel("ms://Org/Other")


def test_run_ids_with_a_slash_are_refused_before_sending(client: TwinkleClient) -> None:
    with pytest.raises(InvalidArgument, match="training_run_id"):
        client.get_training_run("../sessions")
