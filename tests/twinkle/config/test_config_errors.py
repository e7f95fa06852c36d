"""Config mistakes are reported all at once, each with its YAML path and, where possible, the fix."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from twinkle.config import ConfigError, Problem, load_config, parse_config
from twinkle.errors import UserError


def _model_app(**args: Any) -> dict[str, Any]:
    return {
        "name": "m",
        "route_prefix": "/m",
        "import_path": "model",
        "args": {"model_id": "ms://a/b", **args},
    }


def _problems(data: dict[str, Any]) -> list[Problem]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, env={})
    return caught.value.problems


def test_three_different_mistakes_are_all_reported_with_their_paths() -> None:
    data = {
        "http_options": {"port": "eighty"},
        "persistence": {"mode": "file"},
        "applications": [
            {"name": "s", "route_prefix": "/api/v1", "import_path": "server"},
            _model_app(device_group={"rank": 2}),
        ],
    }

    with pytest.raises(ConfigError) as caught:
        parse_config(data, source="bad.yaml", env={})

    paths = [problem.path for problem in caught.value.problems]
    assert paths == ["http_options.port", "persistence.file_path", "applications[1].args.device_group.rank"]
    text = str(caught.value)
    assert text.splitlines()[0] == "bad.yaml: 3 config problems"
    for path in paths:
        assert sum(line.strip().startswith(f"{path}:") for line in text.splitlines()) == 1


def test_a_misspelt_field_suggests_the_closest_valid_one() -> None:
    (problem,) = _problems({"applications": [_model_app(device_group={"rank": 2})]})

    assert problem.path == "applications[0].args.device_group.rank"
    assert problem.message == "unknown field 'rank'"
    assert problem.hint == "did you mean 'ranks'?"


def test_an_unrecognisable_field_lists_the_valid_ones() -> None:
    (problem,) = _problems({"telemetry": {"zzz": 1}})

    assert problem.path == "telemetry.zzz"
    assert problem.hint is not None and "otlp_endpoint" in problem.hint


def test_a_missing_required_field_is_named() -> None:
    data = {"applications": [{"name": "s", "route_prefix": "/s", "import_path": "sampler", "args": {}}]}

    (problem,) = _problems(data)

    assert str(problem) == "applications[0].args.model_id: field required"


@pytest.mark.parametrize(
    ("legacy", "replacement"), [(True, "backend: megatron"), (False, "backend: transformers")]
)
def test_use_megatron_is_refused_with_the_backend_to_write_instead(legacy: bool, replacement: str) -> None:
    (problem,) = _problems({"applications": [_model_app(use_megatron=legacy)]})

    assert problem.path == "applications[0].args.use_megatron"
    assert f"'{replacement}'" in problem.message


def test_a_misspelt_import_path_suggests_the_right_kind() -> None:
    data = {"applications": [{"name": "p", "route_prefix": "/p", "import_path": "procesor"}]}

    (problem,) = _problems(data)

    assert problem.path == "applications[0].import_path"
    assert problem.hint == "did you mean 'processor'?"


def test_a_misspelt_choice_suggests_the_valid_value() -> None:
    (problem,) = _problems({"applications": [_model_app(backend="megatorn")]})

    assert problem.path == "applications[0].args.backend"
    assert problem.hint == "did you mean 'megatron'?"


@pytest.mark.parametrize(
    ("persistence", "path"),
    [({"mode": "file"}, "persistence.file_path"), ({"mode": "redis"}, "persistence.redis_url")],
)
def test_persistence_mode_requires_its_location(persistence: dict[str, str], path: str) -> None:
    (problem,) = _problems({"persistence": persistence})

    assert problem.path == path
    assert persistence["mode"] in problem.message


def test_persistence_modes_with_their_locations_are_valid() -> None:
    file_mode = parse_config({"persistence": {"mode": "file", "file_path": "/tmp/state.json"}})
    redis_mode = parse_config({"persistence": {"mode": "redis", "redis_url": "redis://localhost:6379/1"}})

    assert file_mode.persistence.file_path == "/tmp/state.json"
    assert redis_mode.persistence.redis_url == "redis://localhost:6379/1"


def test_a_redis_url_without_a_redis_scheme_is_refused() -> None:
    (problem,) = _problems({"persistence": {"mode": "redis", "redis_url": "localhost:6379"}})

    assert problem.path == "persistence.redis_url"


def test_raw_api_keys_are_refused_because_only_hashes_may_be_stored() -> None:
    (problem,) = _problems({"auth": {"api_keys": ["a" * 64, "my-secret-key"]}})

    assert problem.path == "auth.api_keys[1]"
    assert "sha256" in (problem.hint or "")


def test_duplicate_application_names_point_at_the_second_one() -> None:
    first, second = _model_app(), _model_app()
    second["route_prefix"] = "/other"
    second["args"]["model_id"] = "ms://c/d"

    (problem,) = _problems({"applications": [first, second]})

    assert problem.path == "applications[1].name"
    assert "applications[0]" in problem.message


def test_a_training_mesh_larger_than_its_device_group_is_refused() -> None:
    (problem,) = _problems(
        {"applications": [_model_app(device_group={"ranks": 2}, device_mesh={"dp_size": 4})]}
    )

    assert problem.path == "applications[0].args.device_mesh"
    assert "4" in problem.message and "2" in problem.message


def test_gpu_as_a_device_type_points_to_cuda() -> None:
    (problem,) = _problems({"applications": [_model_app(device_group={"device_type": "gpu"})]})

    assert problem.path == "applications[0].args.device_group.device_type"
    assert "cuda" in (problem.hint or "")


def test_yaml_syntax_errors_carry_the_line_number(tmp_path: Path) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("http_options:\n  port: 8000\n host: x\n", encoding="utf-8")

    with pytest.raises(ConfigError) as caught:
        load_config(config)

    (problem,) = caught.value.problems
    assert problem.path.startswith("line 3,")
    assert str(config) in str(caught.value)


def test_duplicate_yaml_keys_are_refused_instead_of_the_last_one_silently_winning(tmp_path: Path) -> None:
    config = tmp_path / "twice.yaml"
    config.write_text("http_options:\n  port: 8000\n  port: 9000\n", encoding="utf-8")

    with pytest.raises(ConfigError) as caught:
        load_config(config)

    (problem,) = caught.value.problems
    assert problem.path.startswith("line 3,")
    assert "duplicate key 'port'" in problem.message


def test_a_missing_file_is_a_config_error_that_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")


def test_a_config_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        parse_config(["applications"])


def test_config_errors_are_user_errors_that_survive_pickling() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"http_options": {"port": -1}, "flower": {"basic_auth": "nopassword"}}, source="x.yaml")

    copy = pickle.loads(pickle.dumps(caught.value))

    assert isinstance(copy, UserError)
    assert copy.problems == caught.value.problems
    assert str(copy) == str(caught.value)
    assert [problem["path"] for problem in copy.to_dict()["details"]["problems"]] == [
        "http_options.port",
        "flower.basic_auth",
    ]


def test_yaml_merge_keys_may_be_overridden_without_counting_as_duplicates(tmp_path: Path) -> None:
    config = tmp_path / "anchors.yaml"
    config.write_text(
        "applications:\n"
        "  - name: p\n"
        "    route_prefix: /p\n"
        "    import_path: processor\n"
        "    deployments: [&dep {name: D, max_ongoing_requests: 3}]\n"
        "  - name: q\n"
        "    route_prefix: /q\n"
        "    import_path: processor\n"
        "    deployments:\n"
        "      - <<: *dep\n"
        "        name: E\n",
        encoding="utf-8",
    )

    deployment = load_config(config).applications[1].deployments[0]

    assert (deployment.name, deployment.max_ongoing_requests) == ("E", 3)
