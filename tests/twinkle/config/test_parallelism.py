"""Parallel layouts a backend cannot run are refused when the config is checked, with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from twinkle.config import ConfigError, parse_config
from twinkle.config.parallelism import needs_ray


def config(backend: str, ranks: int = 2, device_type: str = "cuda", ray: dict[str, Any] | None = None,
           **mesh: int) -> dict[str, Any]:
    return {
        "ray": ray or {},
        "applications": [{
            "name": "m", "route_prefix": "/m", "import_path": "model",
            "args": {"backend": backend, "model_id": "ms://a/b",
                     "device_group": {"ranks": ranks, "device_type": device_type}, "device_mesh": mesh},
        }],
    }


@pytest.mark.parametrize(("backend", "mesh", "refused"), [
    ("transformers", {"tp_size": 2}, "tp_size=2 (tensor parallel): the transformers backend"),
    ("mock", {"pp_size": 2}, "pp_size=2 (pipeline parallel): the mock backend"),
    ("megatron", {"pp_size": 2}, "pp_size=2 (pipeline parallel): the megatron backend"),
])
def test_a_layout_the_backend_cannot_run_is_refused_with_the_reason(backend: str, mesh: dict[str, int],
                                                                     refused: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config(backend, **mesh), env={})
    (problem,) = caught.value.problems
    assert problem.path == "applications[0].args.device_mesh"
    assert problem.message.startswith(refused)


def test_expert_parallelism_is_refused_for_transformers_even_though_it_adds_no_ranks() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config("transformers", ranks=2, dp_size=2, ep_size=2), env={})
    assert "ep_size=2 (expert parallel)" in str(caught.value)


@pytest.mark.parametrize(("backend", "mesh"), [("transformers", {"dp_size": 2}), ("mock", {"dp_size": 2}),
                                               ("megatron", {"tp_size": 2})])
def test_data_parallelism_and_megatron_tensor_parallelism_are_accepted(backend: str, mesh: dict[str, int]) -> None:
    parse_config(config(backend, **mesh), env={})


def test_ray_is_needed_only_for_several_ranks_or_a_configured_cluster() -> None:
    def model(raw: dict[str, Any]) -> tuple[Any, Any]:
        parsed = parse_config(raw, env={})
        return parsed, parsed.model_apps()[0].args

    assert needs_ray(*model(config("mock", ranks=2, device_type="cpu", dp_size=2)))
    assert not needs_ray(*model(config("mock", ranks=1, device_type="cpu")))
    assert not needs_ray(*model(config("mock", ranks=0, device_type="cpu")))  # the seed's "CPU index" reading
    assert needs_ray(*model(config("mock", ranks=1, device_type="cpu", ray={"address": "10.0.0.1:6379"})))


def test_check_config_exits_2_naming_the_refused_dimension(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config("transformers", ranks=4, dp_size=2, tp_size=2)))
    done = subprocess.run([sys.executable, "-m", "twinkle.server", "check-config", "-c", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "tp_size=2 (tensor parallel)" in done.stderr and "data parallel only" in done.stderr
