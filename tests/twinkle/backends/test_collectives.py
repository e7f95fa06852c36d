"""The process group's rendezvous store listens on the master's address only, not on every interface."""

from __future__ import annotations

import os

import psutil

from tests.harness import free_port
from twinkle.backends.collectives import rendezvous_store


def test_the_rendezvous_store_listens_on_the_master_address_only() -> None:
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, rank=0, world_size=1)
    store.set("key", "value")
    assert store.get("key") == b"value"
    listening = [c.laddr for c in psutil.Process(os.getpid()).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [address.ip for address in listening] == ["127.0.0.1"]
