"""One API process holds 2,000 pending long-polls over real HTTP: no 503, every one wakes when its future
finishes, and the API's memory grows by less than 100 MB."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from api.redis_client import REDIS_CONNECTIONS
from tests.harness import LaunchedServer, free_port, mock_config
from tests.private_redis import PrivateRedis
from twinkle import blobs
from twinkle.auth import tenant_id
from twinkle.fd_limit import raise_open_files_limit
from twinkle.futures import FutureRecord, new_request_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
POLLS = 2000
KEY = "tml-many-polls"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    tmp = tmp_path_factory.mktemp("long-polls")
    broker = PrivateRedis(tmp / "redis")
    broker.start()
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=0)
    config["broker"]["url"] = broker.url
    launched = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log")
    launched.start()
    yield launched
    launched.stop()
    broker.kill()


def queued_futures(server: LaunchedServer, n: int) -> list[str]:
    """Futures no worker will run (their queue has no consumer): only the test finishes them."""
    ids = [new_request_id() for _ in range(n)]
    pipe = server.redis.pipeline(transaction=False)
    for rid in ids:
        record = FutureRecord(request_id=rid, op="save_state", owner=tenant_id(KEY), model_id="",
                              queue="model.nobody.0", created_at=time.time())
        pipe.hset(server.keys.future(rid), mapping=record.to_hash())
    pipe.execute()
    return ids


def finish(server: LaunchedServer, ids: list[str]) -> None:
    pipe = server.redis.pipeline(transaction=False)
    for rid in ids:
        pipe.set(server.keys.blob_out(rid), blobs.dumps({"path": f"tinker://run/weights/{rid}"}))
        pipe.hset(server.keys.future(rid), "status", "completed")
        pipe.publish(server.keys.done_channel(rid), "completed")
    pipe.execute()


async def poll(port: int, request_id: str) -> tuple[int, dict[str, Any]]:
    """One retrieve_future over a socket of its own (plain HTTP/1.1: httpx costs more CPU than the server)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"request_id": request_id}).encode()
    writer.write(b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: t\r\nX-API-Key: " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
                 str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload or b"{}")


async def hold(port: int, ids: list[str], parked: asyncio.Event) -> list[tuple[int, dict[str, Any]]]:
    calls = [asyncio.create_task(poll(port, rid)) for rid in ids]
    parked.set()
    return await asyncio.gather(*calls)


def connections_to(process: psutil.Process, port: int) -> int:
    return sum(1 for conn in process.net_connections("tcp") if conn.laddr and conn.laddr.port == port
               and conn.status == psutil.CONN_ESTABLISHED)


async def test_two_thousand_pending_long_polls_hold_no_broker_connection_and_all_wake(server: LaunchedServer) -> None:
    raise_open_files_limit()  # this test's own 2,000 sockets
    api = server.api_process()
    port = server.config["http_options"]["port"]
    ids = queued_futures(server, POLLS)
    before = api.memory_info().rss
    parked = asyncio.Event()
    polls = asyncio.create_task(hold(port, ids, parked))
    await parked.wait()
    deadline = time.time() + 60
    while connections_to(api, port) < POLLS:  # every poll is in the API, parked
        assert time.time() < deadline and not polls.done(), connections_to(api, port)
        await asyncio.sleep(0.5)
    await asyncio.sleep(2)  # each has read its record and is waiting
    during = api.memory_info().rss
    broker_connections = len(server.redis.client_list())
    assert broker_connections < REDIS_CONNECTIONS + 30, broker_connections  # the API's pool cap, not one per poll
    finish(server, ids)
    answers = await asyncio.wait_for(polls, 120)  # bounded; a poll that slept through its wake-up says try_again
    statuses: dict[int, int] = {}
    for status, _ in answers:
        statuses[status] = statuses.get(status, 0) + 1
    assert statuses == {200: POLLS}, (statuses, next((b for s, b in answers if s != 200), ""))
    assert all(b.get("type") != "try_again" and b["path"].endswith(rid)
               for (_, b), rid in zip(answers, ids, strict=True))
    assert (during - before) / 2**20 < 100, f"{(during - before) / 2**20:.0f} MB added"
