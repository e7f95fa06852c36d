"""Keys from the seed's Ray Serve configs that change nothing here are named, with why; set keys only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinkle.config import parse_config
from twinkle.config.inert_keys import inert_keys
from twinkle.server.cli import main

SEED = Path(__file__).parents[2] / "fixtures" / "configs" / "seed_transformers.yaml"


def config_with(deployment: dict[str, Any], *, import_path: str = "model", **top: Any) -> Any:
    args: dict[str, Any] = {"model_id": "/models/tiny"} if import_path in ("model", "sampler") else {}
    return parse_config({**top, "applications": [{
        "name": "pool", "route_prefix": "/p", "import_path": import_path, "args": args,
        "deployments": [{"name": "pool", **deployment}]}]})


def test_keys_left_at_their_defaults_are_not_named() -> None:
    assert inert_keys(config_with({})) == []


def test_proxy_location_is_named_when_the_file_sets_it() -> None:
    [note] = inert_keys(config_with({}, proxy_location="HeadOnly"))
    assert note.startswith("proxy_location: accepted for compatibility, no effect")
    assert "--only api" in note


def test_ray_actor_options_of_an_in_process_pool_are_named_with_the_reason() -> None:
    [note] = inert_keys(config_with({"ray_actor_options": {"num_gpus": 1}}))
    assert note.startswith("applications[0].deployments[0].ray_actor_options: accepted for compatibility")
    assert "Ray device group" in note


def test_ray_actor_options_of_a_pool_on_a_ray_device_group_take_effect_and_are_not_named() -> None:
    config = parse_config({"applications": [{
        "name": "pool", "route_prefix": "/p", "import_path": "model",
        "args": {"model_id": "/models/tiny", "device_group": {"ranks": 2, "device_type": "cpu"},
                 "device_mesh": {"dp_size": 2}},
        "deployments": [{"name": "pool", "ray_actor_options": {"num_cpus": 2}}]}]})
    assert inert_keys(config) == []


def test_max_ongoing_requests_is_honoured_by_a_sampler_and_named_on_a_model_pool() -> None:
    assert inert_keys(config_with({"max_ongoing_requests": 8}, import_path="sampler")) == []
    [note] = inert_keys(config_with({"max_ongoing_requests": 8}))
    assert "max_ongoing_requests" in note and "scheduling.window" in note


def test_autoscaling_beyond_min_replicas_is_named() -> None:
    notes = inert_keys(config_with({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                           "target_ongoing_requests": 2}}))
    assert [note.split(":")[0] for note in notes] == [
        "applications[0].deployments[0].autoscaling_config.max_replicas",
        "applications[0].deployments[0].autoscaling_config.target_ongoing_requests"]


def test_check_config_prints_a_note_per_inert_key_of_the_seed_config(capsys: Any) -> None:
    assert main(["check-config", "-c", str(SEED)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "accepted for compatibility" in line]
    assert notes and all(line.startswith("note: ") for line in notes)
    assert any("max_ongoing_requests" in line for line in notes)
    assert any("ray_actor_options" in line for line in notes)


def test_a_sampler_pools_batch_is_its_max_ongoing_requests_unless_engine_args_name_one() -> None:
    from workers.pool import sampler_slots

    sampler = config_with({"max_ongoing_requests": 8}, import_path="sampler").app("pool")
    assert sampler_slots(sampler) == 8
    sampler.args.engine_args["max_num_seqs"] = 4
    assert sampler_slots(sampler) == 4
    assert sampler_slots(config_with({}, import_path="sampler").app("pool")) == 16
