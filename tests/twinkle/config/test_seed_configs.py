"""The examples of the product documentation (tests/fixtures/configs/seed_*.yaml) are valid configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from twinkle.config import ConfigError, ModelApp, load_config, parse_config

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


@pytest.mark.parametrize("name", ["seed_megatron.yaml", "seed_transformers.yaml"])
def test_complete_seed_examples_validate_with_their_four_applications(name: str) -> None:
    config = load_config(FIXTURES / name)

    assert [app.import_path for app in config.applications] == ["server", "model", "sampler", "processor"]
    assert config.persistence.mode == "file"
    assert config.telemetry.enabled is True


def test_megatron_seed_keeps_every_value_it_sets() -> None:
    config = load_config(FIXTURES / "seed_megatron.yaml")
    (model,) = config.model_apps()
    (sampler,) = config.sampler_apps()
    (processor,) = config.processor_apps()
    server = config.server_app()

    assert server is not None and server.args.server_config.per_token_model_limit == 3
    assert server.args.supported_models == ["Qwen/Qwen3.5-4B"]
    assert server.deployments[0].max_ongoing_requests == 50
    assert model.args.backend == "megatron"
    assert model.args.max_length == 10240
    assert model.args.queue_config.max_input_tokens == 10000
    assert model.args.adapter_config.adapter_timeout == 30
    assert model.args.adapter_config.max_loras == 1
    assert model.deployments[0].runtime_env.env_vars == {"TWINKLE_TRUST_REMOTE_CODE": "0"}
    assert sampler.args.sampler_type == "vllm"
    assert sampler.args.engine_args["gpu_memory_utilization"] == 0.5
    assert sampler.args.engine_args["logprobs_mode"] == "processed_logprobs"
    assert processor.args.device_group.device_type == "cpu"
    assert processor.args.device_mesh.device_type == "cpu"


def test_transformers_seed_differs_from_the_megatron_one_only_in_the_model_application() -> None:
    megatron = load_config(FIXTURES / "seed_megatron.yaml")
    transformers = load_config(FIXTURES / "seed_transformers.yaml")

    assert transformers.model_apps()[0].args.backend == "transformers"
    assert transformers.model_apps()[0].args.adapter_config.adapter_timeout == 1800
    assert transformers.model_dump(exclude={"applications"}) == megatron.model_dump(exclude={"applications"})
    for ours, theirs in zip(transformers.applications, megatron.applications, strict=True):
        if not isinstance(ours, ModelApp):
            assert ours == theirs


def test_node_rank_fragment_fails_naming_the_missing_model_ids() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(FIXTURES / "seed_node_rank.yaml")

    assert [(problem.path, problem.message) for problem in caught.value.problems] == [
        ("applications[0].args.model_id", "field required"),
        ("applications[1].args.model_id", "field required"),
    ]
    assert "model_id" in str(caught.value)


def test_node_rank_fragment_validates_once_its_pools_name_a_model() -> None:
    data = yaml.safe_load((FIXTURES / "seed_node_rank.yaml").read_text(encoding="utf-8"))
    for application in data["applications"]:
        if application["import_path"] in ("model", "sampler"):
            application["args"]["model_id"] = "ms://Qwen/Qwen3.5-4B"

    config = parse_config(data)

    assert [app.args.device_group.ranks for app in config.applications] == [4, 2, 0]
    assert config.processor_apps()[0].args.device_mesh.dp_size == 4
    assert config.server_app() is None
