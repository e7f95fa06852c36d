"""Defaults, normalisation and lookups of the config models."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

import twinkle.config as config_package
from twinkle.config import (
    Application,
    ConfigError,
    DeviceGroup,
    ModelArgs,
    SamplerArgs,
    ServerConfig,
    config_to_dict,
    parse_config,
)
from twinkle.errors import UserError

CONFIG_MODELS = [
    getattr(config_package, name)
    for name in config_package.__all__
    if isinstance(getattr(config_package, name), type)
    and issubclass(getattr(config_package, name), BaseModel)
]


def _apps() -> list[dict[str, Any]]:
    return [
        {"name": "api", "route_prefix": "/api/v1", "import_path": "server"},
        {"name": "base", "route_prefix": "/m", "import_path": "model", "args": {"model_id": "hf://org/base"}},
        {
            "name": "gen",
            "route_prefix": "/s",
            "import_path": "sampler",
            "args": {"model_id": "local/base", "served_model_name": "base-chat"},
        },
        {"name": "proc", "route_prefix": "/p", "import_path": "processor"},
    ]


def test_an_empty_config_takes_safe_defaults() -> None:
    config = parse_config({})

    assert config.http_options.host == "127.0.0.1"
    assert config.http_options.port == 8000
    assert config.persistence.mode == "memory"
    assert config.broker.url is None
    assert config.storage.max_request_bytes == 64 * 1024 * 1024
    assert config.auth.dev_mode is True
    assert config.ray_namespace == "twinkle_cluster"
    assert config.applications == []


@pytest.mark.parametrize("model", CONFIG_MODELS, ids=lambda model: model.__name__)
def test_every_config_model_forbids_unknown_fields(model: type[BaseModel]) -> None:
    assert model.model_config.get("extra") == "forbid"


@pytest.mark.parametrize("model", CONFIG_MODELS, ids=lambda model: model.__name__)
def test_every_config_field_is_described(model: type[BaseModel]) -> None:
    undocumented = [name for name, field in model.model_fields.items() if not _described(field)]
    assert undocumented == []


def _described(field: FieldInfo) -> bool:
    return bool(field.description and field.description.strip())


def test_kind_lookups_return_the_applications_in_config_order() -> None:
    config = parse_config({"applications": _apps()})

    assert config.server_app() is not None
    assert [app.name for app in config.model_apps()] == ["base"]
    assert [app.name for app in config.sampler_apps()] == ["gen"]
    assert [app.name for app in config.processor_apps()] == ["proc"]
    assert config.app("gen") is config.applications[2]


def test_an_unknown_application_name_is_a_user_error_with_a_suggestion() -> None:
    config = parse_config({"applications": _apps()})

    with pytest.raises(UserError, match="did you mean 'gen'"):
        config.app("gne")


def test_served_names_drop_the_hub_scheme_unless_a_name_is_given() -> None:
    assert ModelArgs(model_id="ms://Qwen/Qwen3.5-4B").served_name == "Qwen/Qwen3.5-4B"
    assert ModelArgs(model_id="hf://org/m").served_name == "org/m"
    assert ModelArgs(model_id="/models/m").served_name == "/models/m"
    assert SamplerArgs(model_id="ms://a/b", served_model_name="chat").served_name == "chat"


def test_two_model_pools_serving_the_same_name_are_refused() -> None:
    apps = _apps()
    twin = {
        "name": "twin",
        "route_prefix": "/m2",
        "import_path": "model",
        "args": {"model_id": "ms://org/base"},
    }

    with pytest.raises(ConfigError) as caught:
        parse_config({"applications": [*apps, twin]})

    (problem,) = caught.value.problems
    assert problem.path == "applications[4].args.served_model_name"


def test_device_types_are_normalised_to_lower_case() -> None:
    assert DeviceGroup(device_type="CPU").device_type == "cpu"  # type: ignore[arg-type]


def test_a_device_mesh_without_device_type_takes_the_groups() -> None:
    args = ModelArgs(model_id="m", device_group=DeviceGroup(device_type="npu"))

    assert args.device_mesh.device_type == "npu"


def test_a_device_mesh_on_another_device_type_than_its_group_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"differs from device_group\.device_type"):
        ModelArgs.model_validate({"model_id": "m", "device_mesh": {"device_type": "cpu"}})


def test_known_engine_args_are_type_checked_and_unknown_ones_pass_through() -> None:
    args = SamplerArgs.model_validate(
        {"model_id": "m", "engine_args": {"max_model_len": "4096", "enforce_eager": True}}
    )

    assert args.engine_args == {"max_model_len": 4096, "enforce_eager": True}
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        SamplerArgs.model_validate({"model_id": "m", "engine_args": {"gpu_memory_utilization": 0}})
    with pytest.raises(ValidationError, match="enable_lora"):
        SamplerArgs.model_validate({"model_id": "m", "engine_args": {"enable_lora": "sometimes"}})


def test_numeric_environment_values_become_strings() -> None:
    app = {**_apps()[3], "deployments": [{"name": "d", "runtime_env": {"env_vars": {"A": 0, "B": 1.5}}}]}

    config = parse_config({"applications": [app]})

    assert config.applications[0].deployments[0].runtime_env.env_vars == {"A": "0", "B": "1.5"}


def test_applications_are_typed_by_their_import_path() -> None:
    config = parse_config({"applications": _apps()})

    assert all(isinstance(app, Application) for app in config.applications)
    assert [type(app.args).__name__ for app in config.applications] == [
        "ServerArgs",
        "ModelArgs",
        "SamplerArgs",
        "ProcessorArgs",
    ]


def test_config_to_dict_fills_defaults_and_round_trips_through_json() -> None:
    config = parse_config({"applications": _apps(), "persistence": {"mode": "file", "file_path": "/s.json"}})

    data = json.loads(json.dumps(config_to_dict(config)))

    assert data["telemetry"]["export_interval_ms"] == 30000
    assert data["applications"][1]["args"]["adapter_config"]["max_loras"] == 8
    assert parse_config(data) == config
    assert isinstance(parse_config(data), ServerConfig)
