"""twinkle/server/leftovers.py: what a dead launcher left is killed, session-wide; nothing else is."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.twinkle.server.process_tree import Tree, dead_pid, start_tree
from twinkle.errors import LaunchAlreadyRuns
from twinkle.server import launch_record, leftovers, process_table
from twinkle.server.launch_record import ChildRecord, LaunchRecord

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
BROKER = "redis://127.0.0.1:1/0"
QUEUE = "model.models-tiny.0"


@pytest.fixture
def trees() -> Iterator[list[Tree]]:
    started: list[Tree] = []
    yield started
    for tree in started:
        tree.kill()


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(launch_record.STATE_DIR_ENV, str(tmp_path / "state"))
    return tmp_path / "state"


def a_tree(trees: list[Tree]) -> Tree:
    tree = start_tree()
    trees.append(tree)
    return tree


def dead_launch(name: str, tree: Tree, queue: str = QUEUE, port: int = 0) -> LaunchRecord:
    """The record of a launcher that is gone, naming `tree` as its worker."""
    child = ChildRecord("worker models-tiny#0", tree.pid, tree.started[tree.pid], queue)
    return LaunchRecord(dead_pid(), port, BROKER, "/cfg.yaml", started=1, name=name, children=(child,))


def test_killing_a_childs_session_takes_its_group_and_a_grandchild_in_a_group_of_its_own(trees: list[Tree]) -> None:
    tree = a_tree(trees)

    killed = leftovers.kill_session(tree.pid, tree.started[tree.pid])
    tree.leader.wait(5)

    assert sorted(killed) == sorted([tree.pid, *tree.grandchildren])
    assert tree.running() == []


def test_a_session_whose_leader_exited_is_still_cleared(trees: list[Tree]) -> None:
    tree = a_tree(trees)
    tree.leader.kill()
    tree.leader.wait()

    assert sorted(leftovers.kill_session(tree.pid, tree.started[tree.pid])) == sorted(tree.grandchildren)
    assert tree.running() == []


def test_a_pid_that_now_names_a_process_started_at_another_time_is_left_alone(trees: list[Tree]) -> None:
    tree = a_tree(trees)

    assert leftovers.kill_session(tree.pid, tree.started[tree.pid] - 1) == []
    assert len(tree.running()) == 3


def test_a_dead_launch_that_ran_this_launchs_queue_is_cleared_with_one_line_and_its_record_dropped(
        trees: list[Tree]) -> None:
    tree = a_tree(trees)
    old = launch_record.write(dead_launch("launch-worker-models-tiny-r0-abc", tree))
    mine = LaunchRecord(os.getpid(), 8000, BROKER, "/cfg.yaml", name="launch-8000",
                        children=(ChildRecord("worker models-tiny#0", 0, 0, QUEUE),))

    (line,) = leftovers.clear_predecessors(mine)

    assert line.startswith("cleared what launcher PID ") and f"worker models-tiny#0 (PID {tree.pid}) and 2 " in line
    assert tree.running() == []
    assert old is not None and not old.exists()


def test_a_dead_launch_with_nothing_in_common_keeps_its_processes_and_a_gone_one_loses_its_record(
        trees: list[Tree]) -> None:
    other_queue = launch_record.write(dead_launch("launch-worker-other-r0-abc", a_tree(trees), "model.other.0"))
    gone_tree = a_tree(trees)
    gone_tree.kill()
    gone = launch_record.write(dead_launch("launch-9000", gone_tree, "model.gone.0", port=9000))
    mine = LaunchRecord(os.getpid(), 8000, BROKER, "/cfg.yaml", name="launch-8000",
                        children=(ChildRecord("worker models-tiny#0", 0, 0, QUEUE),))

    assert leftovers.clear_predecessors(mine) == []
    assert len(trees[0].running()) == 3
    assert other_queue is not None and other_queue.exists()
    assert gone is not None and not gone.exists()


def test_a_record_of_another_node_sharing_the_state_dir_is_neither_cleared_nor_removed(trees: list[Tree]) -> None:
    tree = a_tree(trees)
    other = dead_launch("launch-worker-models-tiny-r0-abc@node-b", tree)
    path = launch_record.write(LaunchRecord(**{**other.__dict__, "node": "another-boot/pid:[1]"}))
    mine = LaunchRecord(os.getpid(), 8000, BROKER, "/cfg.yaml", name="launch-8000",
                        children=(ChildRecord("worker models-tiny#0", 0, 0, QUEUE),))

    assert leftovers.clear_predecessors(mine) == []
    assert len(tree.running()) == 3 and path is not None and path.exists()


def test_a_running_launch_of_the_same_queue_refuses_the_second_and_names_its_pid() -> None:
    me = process_table.started(os.getpid()) or 0
    running = LaunchRecord(os.getpid(), 0, BROKER, "/cfg.yaml", started=me, name="launch-worker-models-tiny-r0-abc",
                           children=(ChildRecord("worker models-tiny#0", 1, 1, QUEUE),))
    launch_record.write(running)
    second = LaunchRecord(dead_pid(), 8000, BROKER, "/cfg.yaml", name="launch-8000",
                          children=(ChildRecord("worker models-tiny#0", 0, 0, QUEUE),))

    with pytest.raises(LaunchAlreadyRuns) as caught:
        leftovers.clear_predecessors(second)

    assert f"launcher PID {os.getpid()}" in str(caught.value) and QUEUE in str(caught.value)
    on_another_broker = LaunchRecord(second.pid, 8000, "redis://elsewhere:6379/0", "/cfg.yaml", name="launch-8000",
                                     children=second.children)
    assert leftovers.clear_predecessors(on_another_broker) == []
