"""docker/: the compose files are valid and run exactly the roles of the bundled server config.

`docker compose config` checks the files when the Docker CLI has its compose plugin (no engine needed);
the structural checks below run everywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from twinkle.catalog import model_queue, processor_queue, sampler_queue
from twinkle.config import load_config
from twinkle.keys import Keys
from twinkle.server.cli import build_parser

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE, GPU = DOCKER / "compose.yaml", DOCKER / "compose.gpu.yaml"


def services(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data["services"]  # type: ignore[no-any-return]


def compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not compose_plugin(), reason="the docker CLI here has no compose plugin")
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, GPU]])
def test_docker_compose_accepts_the_files(files: list[Path]) -> None:
    args = [arg for f in files for arg in ("-f", str(f))]
    done = subprocess.run(["docker", "compose", *args, "config", "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_there_is_one_worker_service_per_pool_of_the_bundled_config_and_every_role_parses() -> None:
    config = load_config(DOCKER / "server_config.yaml", env={})
    pools = {app.name for app in config.applications if app.import_path != "server"}
    roles: dict[str, list[str]] = {}
    for name, service in services(COMPOSE).items():
        if name == "redis":
            continue
        command = service["command"]
        build_parser().parse_args(["launch", "-c", "cfg.yaml", *command])  # the CLI accepts it
        assert command[:1] == ["--only"], name
        roles.setdefault(command[1], []).append(command[2] if command[1] == "worker" else name)
    assert sorted(roles) == ["api", "flower", "worker"]
    assert sorted(roles["worker"]) == sorted(pools)  # each pool exactly once, and no unknown names


def test_every_service_has_a_healthcheck_and_waits_for_a_healthy_persistent_redis() -> None:
    spec = services(COMPOSE)
    redis = spec["redis"]
    assert redis["command"][1:3] == ["--appendonly", "yes"]
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    for name, service in spec.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        if name != "redis":
            assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
            assert "TWINKLE_BROKER_URL" in service["environment"], name


def test_worker_healthchecks_watch_the_heartbeat_of_their_own_pool() -> None:
    config = load_config(DOCKER / "server_config.yaml", env={})
    for service in services(COMPOSE).values():
        command = service["command"]
        if command[:2] != ["--only", "worker"]:
            continue
        app = config.app(command[2])
        if app.import_path == "model":
            queue = model_queue(app.name, 0)
        else:
            queue = sampler_queue(app.name) if app.import_path == "sampler" else processor_queue(app.name)
        assert f"'{Keys().pool_heartbeat(queue)}'" in service["healthcheck"]["test"][-1]


def test_images_build_from_existing_dockerfiles_that_pin_torch_as_pyproject_does() -> None:
    pyproject = tomllib.loads((DOCKER.parent / "pyproject.toml").read_text())
    (torch_pin,) = [d for d in pyproject["project"]["optional-dependencies"]["server"] if d.startswith("torch")]
    gpu = services(GPU)
    assert set(gpu) <= set(services(COMPOSE))  # the override only changes services that exist
    for service in [*services(COMPOSE).values(), *gpu.values()]:
        if "build" not in service:
            continue
        dockerfile = DOCKER / service["build"]["context"] / service["build"]["dockerfile"]
        text = dockerfile.read_text()
        assert torch_pin in text, dockerfile
        assert re.search(r'^ENTRYPOINT \["twinkle-server", "launch"\]$', text, re.M), dockerfile
        for copied in re.findall(r"^COPY (\S+) ", text, re.M):
            assert (DOCKER.parent / copied).exists(), copied
    assert "nvidia/cuda:" in (DOCKER / "Dockerfile.cuda").read_text()
    for volume in services(COMPOSE)["api"]["volumes"]:
        source = volume.split(":")[0]
        assert not source.startswith(".") or (DOCKER / source).exists(), volume
