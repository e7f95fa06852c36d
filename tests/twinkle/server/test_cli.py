"""`twinkle-server` / `python -m twinkle.server`: argument handling, exit codes and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from twinkle.config import ServerConfig, parse_config
from twinkle.server.cli import main

REPO = Path(__file__).resolve().parents[3]
SEED = REPO / "tests" / "fixtures" / "configs" / "seed_megatron.yaml"
NODE_RANK = REPO / "tests" / "fixtures" / "configs" / "seed_node_rank.yaml"


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TWINKLE_SERVER_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "twinkle.server", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: Any) -> None:
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture(autouse=True)
def _no_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINKLE_SERVER_CONFIG", raising=False)
    monkeypatch.delenv("TWINKLE_RAY_NAMESPACE", raising=False)


def test_check_config_exits_0_and_lists_the_applications_of_a_valid_config() -> None:
    result = _run_module("check-config", "-c", str(SEED))

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: 4 applications (")
    assert "models-Qwen3.5-4B" in result.stdout


def test_check_config_exits_2_and_prints_every_problem_to_stderr() -> None:
    result = _run_module("check-config", "--config", str(NODE_RANK))

    assert result.returncode == 2
    assert result.stdout == ""
    assert "applications[0].args.model_id: field required" in result.stderr
    assert "applications[1].args.model_id: field required" in result.stderr


def test_the_config_path_defaults_to_twinkle_server_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TWINKLE_SERVER_CONFIG", str(SEED))

    assert main(["check-config"]) == 0
    assert capsys.readouterr().out.startswith("ok: 4 applications")


def test_a_missing_config_option_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["check-config"])

    assert caught.value.code == 2


def test_print_config_json_round_trips_through_parse_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["print-config", "-c", str(SEED), "--format", "json"]) == 0

    data = json.loads(capsys.readouterr().out)

    assert data["applications"][1]["args"]["adapter_config"]["snapshot_interval"] == 0
    assert parse_config(data) == parse_config(yaml.safe_load(SEED.read_text(encoding="utf-8")))


def test_print_config_defaults_to_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["print-config", "-c", str(SEED)]) == 0

    data = yaml.safe_load(capsys.readouterr().out)

    assert data["storage"]["checkpoint_dir"] == "./outputs"
    assert parse_config(data).model_apps()[0].args.backend == "megatron"


def test_launch_passes_the_validated_config_and_roles_to_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []

    def launch(**kwargs: Any) -> int:
        calls.append(kwargs)
        return 7

    _fake_module(monkeypatch, "twinkle.server.launcher", launch=launch)

    assert main(["launch", "-c", str(SEED), "--only", "worker", "processor", "--namespace", "ns1"]) == 7

    (call,) = calls
    assert call["config_path"] == str(SEED)
    assert isinstance(call["config"], ServerConfig)
    assert (call["only"], call["only_name"], call["namespace"]) == ("worker", "processor", "ns1")


def test_launch_takes_the_namespace_from_the_environment_then_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    namespaces: list[str] = []
    _fake_module(
        monkeypatch,
        "twinkle.server.launcher",
        launch=lambda **kwargs: namespaces.append(kwargs["namespace"]) or 0,
    )

    main(["launch", "-c", str(SEED), "--only", "api"])
    monkeypatch.setenv("TWINKLE_RAY_NAMESPACE", "from-env")
    main(["launch", "-c", str(SEED), "--only", "api"])

    assert namespaces == ["twinkle_cluster", "from-env"]


def test_launch_refuses_pools_this_machine_cannot_run_and_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("twinkle.backends.megatron.requirements.megatron_requirements_problem",
                        lambda: "backend: megatron needs megatron-core and a CUDA GPU")
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: 0)

    assert main(["launch", "-c", str(SEED), "--only", "worker", "models-Qwen3.5-4B"]) == 1
    assert "megatron needs megatron-core" in capsys.readouterr().err


@pytest.mark.parametrize(
    "only",
    [["worker"], ["worker", "nope"], ["worker", "server"], ["api", "extra"], ["gpu"]],
    ids=["worker-without-name", "unknown-worker", "server-is-no-worker", "api-with-name", "unknown-role"],
)
def test_launch_refuses_a_malformed_only(monkeypatch: pytest.MonkeyPatch, only: list[str]) -> None:
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: pytest.fail("launched"))

    with pytest.raises(SystemExit) as caught:
        main(["launch", "-c", str(SEED), "--only", *only])

    assert caught.value.code == 2


def test_launch_with_an_invalid_config_exits_2_without_launching(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: pytest.fail("launched"))

    assert main(["launch", "-c", str(NODE_RANK)]) == 2
    assert "model_id: field required" in capsys.readouterr().err


def test_clear_persistence_prints_how_many_keys_were_removed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[ServerConfig] = []
    _fake_module(
        monkeypatch,
        "twinkle.state.persistence",
        clear_persistence=lambda config, broker_url=None: seen.append(config) or 12,
    )

    assert main(["clear", "persistence", "-c", str(SEED)]) == 0

    assert seen[0].persistence.file_path == "/tmp/twinkle_state.json"
    assert "removed 12 keys" in capsys.readouterr().out


def test_user_errors_from_a_command_exit_1_with_the_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from twinkle.errors import UserError

    def refuse(config: ServerConfig, broker_url: str | None = None) -> int:
        raise UserError("memory persistence has nothing to clear", hint="stop the server instead")

    _fake_module(monkeypatch, "twinkle.state.persistence", clear_persistence=refuse)

    assert main(["clear", "persistence", "-c", str(SEED)]) == 1
    assert "error: memory persistence has nothing to clear" in capsys.readouterr().err


def test_build_tiny_model_passes_only_the_given_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Path, dict[str, Any]]] = []

    def build_tiny_model(out_dir: Path, **kwargs: Any) -> Path:
        calls.append((out_dir, kwargs))
        return out_dir

    _fake_module(monkeypatch, "twinkle.tiny_model", build_tiny_model=build_tiny_model)

    assert main(["build-tiny-model", str(tmp_path / "a"), "--vocab-size", "300", "--seed", "3"]) == 0
    assert main(["build-tiny-model", str(tmp_path / "b")]) == 0

    assert calls == [(tmp_path / "a", {"vocab_size": 300, "seed": 3}), (tmp_path / "b", {})]
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "a"), str(tmp_path / "b")]


def _config_with_model(tmp_path: Path, model_id: str, backend: str = "transformers") -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}},
        {"name": "models-x", "route_prefix": "/api/v1/model/x", "import_path": "model",
         "args": {"backend": backend, "model_id": model_id}},
        {"name": "sampler-x", "route_prefix": "/api/v1/sampler/x", "import_path": "sampler",
         "args": {"model_id": model_id, "sampler_type": "mock" if backend == "mock" else "torch"}},
    ]}))
    return path


def test_check_config_exits_2_naming_each_missing_model_directory_and_how_to_build_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    config = _config_with_model(tmp_path, "./models/tiny-qwen")

    assert main(["check-config", "-c", str(config)]) == 2

    err = capsys.readouterr().err
    assert "applications[1].args.model_id: no model directory at './models/tiny-qwen'" in err
    assert "applications[2].args.model_id: no model directory" in err
    assert f"looked in {tmp_path / 'models' / 'tiny-qwen'}" in err
    assert "twinkle-server build-tiny-model ./models/tiny-qwen" in err


def test_check_config_accepts_hub_ids_a_model_directory_and_the_mocks_vocabulary_size(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for model_id, backend in (("ms://Qwen/Qwen3.5-4B", "transformers"), ("Qwen/Qwen3-0.6B", "transformers"),
                              (str(tiny_model_dir), "transformers"), ("1000", "mock")):
        assert main(["check-config", "-c", str(_config_with_model(tmp_path, model_id, backend))]) == 0, model_id
    capsys.readouterr()

    (tmp_path / "not-a-model").mkdir()
    assert main(["check-config", "-c", str(_config_with_model(tmp_path, str(tmp_path / "not-a-model")))]) == 2
    assert "is a directory without config.json" in capsys.readouterr().err


def test_launch_refuses_a_missing_model_directory_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: pytest.fail("launched"))
    config = _config_with_model(tmp_path, str(tmp_path / "missing"))

    assert main(["launch", "-c", str(config)]) == 2
    assert "no model directory at" in capsys.readouterr().err
    # the API alone loads no model: a node without the model files may run it
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: 0)
    assert main(["launch", "-c", str(config), "--only", "api"]) == 0


def test_launch_passes_v_on_to_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: calls.append(kwargs) or 0)

    main(["launch", "-c", str(SEED), "--only", "api"])
    main(["launch", "-c", str(SEED), "--only", "api", "-v"])

    assert [call["verbose"] for call in calls] == [False, True]


def test_export_merged_without_an_api_key_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TWINKLE_SERVER_TOKEN", raising=False)
    assert main(["export-merged", "twinkle://r/weights/a", "out"]) == 2
    assert "needs an API key" in capsys.readouterr().err


def _two_replica_config(tmp_path: Path) -> Path:
    path = tmp_path / "replicas.yaml"
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "broker": {"url": "redis://127.0.0.1:6379/0"},
        "applications": [
            {"name": "server", "route_prefix": "/api/v1", "import_path": "server", "args": {}},
            {"name": "models-x", "route_prefix": "/api/v1/model/x", "import_path": "model",
             "args": {"backend": "mock", "model_id": "1000"},
             "deployments": [{"name": "pool", "autoscaling_config": {"min_replicas": 2, "max_replicas": 2}}]},
            {"name": "processor", "route_prefix": "/api/v1/processor", "import_path": "processor", "args": {}},
        ]}))
    return path


def test_launch_passes_the_chosen_replicas_and_the_listen_address_to_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: calls.append(kwargs) or 0)
    config = str(_two_replica_config(tmp_path))

    assert main(["launch", "-c", config, "--only", "worker", "models-x", "--replica", "1"]) == 0
    assert main(["launch", "-c", config, "--only", "worker", "models-x", "--replica", "0", "--replica", "1"]) == 0
    assert main(["launch", "-c", config, "--only", "worker", "models-x"]) == 0
    assert main(["launch", "-c", config, "--only", "api", "--host", "0.0.0.0", "--port", "8001"]) == 0
    assert main(["launch", "-c", config, "--port", "8002"]) == 0

    assert [call["replicas"] for call in calls[:3]] == [[1], [0, 1], None]
    listen = [(call["config"].http_options.host, call["config"].http_options.port) for call in calls]
    assert listen[2:] == [("127.0.0.1", 8000), ("0.0.0.0", 8001), ("127.0.0.1", 8002)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "worker", "models-x", "--replica", "2"], "models-x has no replica 2: it runs replicas 0 to 1"),
        (["--only", "worker", "processor", "--replica", "1"], "processor has no replica 1: it runs one replica, 0"),
        (["--replica", "0"], "--replica needs --only worker NAME"),
        (["--only", "api", "--replica", "0"], "--replica needs --only worker NAME"),
        (["--only", "worker", "models-x", "--port", "8001"], "--only worker runs no API"),
        (["--port", "70000"], "70000 is not a TCP port"),
    ],
    ids=["replica-out-of-range", "single-replica-pool", "replica-without-only", "replica-with-api",
         "port-without-api", "port-out-of-range"],
)
def test_launch_refuses_replicas_a_pool_lacks_and_a_listen_address_without_an_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
    message: str
) -> None:
    _fake_module(monkeypatch, "twinkle.server.launcher", launch=lambda **kwargs: pytest.fail("launched"))

    with pytest.raises(SystemExit) as caught:
        main(["launch", "-c", str(_two_replica_config(tmp_path)), *args])

    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_stop_ray_needs_a_gcs_address_and_says_when_nothing_of_that_cluster_runs_here(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["stop-ray"])
    assert caught.value.code == 2
    assert "pass --address HOST:PORT" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        main(["stop-ray", "--address", "no-port"])
    assert "'no-port' is not HOST:PORT" in capsys.readouterr().err

    assert main(["stop-ray", "--address", "127.0.0.1:1"]) == 0
    assert "no Ray process of the cluster at 127.0.0.1:1 runs on this machine" in capsys.readouterr().out
