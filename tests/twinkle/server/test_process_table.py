"""twinkle/server/process_table.py on this machine's /proc."""

from __future__ import annotations

import os
import sys

import pytest

from tests.twinkle.server.process_tree import dead_pid, start_tree
from twinkle.server import process_table

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_process_reads_as_its_own_group_session_parent_and_a_start_time_that_does_not_change() -> None:
    me = process_table.read(os.getpid())

    assert me is not None
    assert (me.ppid, me.group, me.session) == (os.getppid(), os.getpgrp(), os.getsid(0))
    assert me.started > 0 and process_table.started(os.getpid()) == me.started
    assert process_table.runs(os.getpid(), me.started)
    assert not process_table.runs(os.getpid(), me.started + 1)  # the same pid, started at another time


def test_an_exited_process_reads_as_none() -> None:
    assert process_table.read(dead_pid()) is None


def test_the_members_of_a_session_include_a_grandchild_in_a_process_group_of_its_own() -> None:
    tree = start_tree()
    try:
        members = {info.pid for info in process_table.members(tree.pid)}
        own_group = process_table.read(tree.grandchildren[1])

        assert members == {tree.pid, *tree.grandchildren}
        assert own_group is not None and own_group.group != tree.pid and own_group.session == tree.pid
        assert process_table.descendants({tree.pid}, process_table.everyone()) == members
        assert process_table.command_line(tree.grandchildren[0])[-1] == "import time; time.sleep(600)"
    finally:
        tree.kill()
