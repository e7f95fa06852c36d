"""twinkle/server/launch_record.py: names that say what a launch runs, and records that survive a round trip."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.twinkle.server.process_tree import dead_pid
from twinkle.server import launch_record, process_table
from twinkle.server.launch_record import ChildRecord, LaunchRecord


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(launch_record.STATE_DIR_ENV, str(tmp_path / "state"))
    return tmp_path / "state"


def test_a_launch_with_an_api_is_named_by_its_port_and_a_worker_launch_by_pool_replicas_and_config() -> None:
    def name(only: str | None, pool: str | None = None, replicas: list[int] = (), config: str = "/a.yaml") -> str:
        return launch_record.record_name(config, only, pool, replicas, port=8000, flower_port=5555)

    host = socket.gethostname()
    assert name(None) == name("api") == f"launch-8000@{host}"
    assert name("flower") == f"launch-flower-5555@{host}"
    assert name("worker", "models-tiny", [1, 0]).startswith("launch-worker-models-tiny-r0-1-")
    assert name("worker", "models-tiny", [1, 0]).endswith(f"@{host}")
    assert name("worker", "models-tiny", [0]) != name("worker", "models-tiny", [1])
    assert name("worker", "models-tiny", [0]) != name("worker", "models-tiny", [0], config="/b.yaml")
    assert "/" not in name("worker", "org/model x", [0])


def test_a_record_reads_back_with_its_children_readable_by_this_user_only(state_dir: Path) -> None:
    name = launch_record.record_name("/a.yaml", None, None, [], 8000, 5555)
    record = LaunchRecord(os.getpid(), 8000, "redis://:secret@127.0.0.1:6379/0", "/a.yaml",
                          started=process_table.started(os.getpid()) or 0, name=name,
                          children=(ChildRecord("api", 11, 22), ChildRecord("worker m#0", 12, 23, "model.m.0")),
                          node=process_table.node())

    path = launch_record.write(record)

    assert path == state_dir / f"{name}.json" and path.stat().st_mode & 0o777 == 0o600
    assert launch_record.read(path) == record
    assert launch_record.find(8000) == record
    assert record.queues() == {"model.m.0"}


def test_a_record_whose_launcher_died_or_whose_pid_was_handed_out_again_is_not_a_running_launch() -> None:
    def at(port: int) -> str:
        return launch_record.record_name("/a.yaml", None, None, [], port, 5555)

    dead = LaunchRecord(dead_pid(), 8001, "redis://x", "/a.yaml", name=at(8001))
    reused = LaunchRecord(os.getpid(), 8002, "redis://x", "/a.yaml", started=1, name=at(8002))
    elsewhere = LaunchRecord(os.getpid(), 8003, "redis://x", "/a.yaml", started=process_table.started(os.getpid()) or 0,
                             name=at(8003), node="another-boot/pid:[1]")
    for record in (dead, reused, elsewhere):
        launch_record.write(record)

    assert not dead.launcher_runs() and not reused.launcher_runs()
    assert launch_record.find(8001) is None and launch_record.find(8002) is None
    assert not elsewhere.here() and elsewhere.launcher_runs(), "another node's launcher cannot be judged from here"
    assert launch_record.find(8003) is None, "its pid means nothing on this node"


def test_a_record_of_an_older_twinkle_without_children_still_reads(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    path = state_dir / "launch-8004.json"
    path.write_text('{"pid": 1, "port": 8004, "broker_url": "redis://x", "config": "/a.yaml"}')

    record = launch_record.read(path)

    assert record is not None and record.name == "launch-8004" and record.children == () and record.here()
