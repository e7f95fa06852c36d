from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.harness import REDIS_HOST, REDIS_PORT, LaunchedServer, launch, require_redis
from tests.private_redis import PrivateRedis
from twinkle.keys import Keys
from twinkle.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen-family model with a BPE tokenizer, built once per test session."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen")


@pytest.fixture(scope="session")
def mock_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    """A launched server (API + mock model, sampler and processor pools) shared by the e2e tests."""
    server = launch(tmp_path_factory.mktemp("mock-server"), tiny_model_dir, db=11, sampler=True, processor=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def transformers_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    """The same layout on the transformers backend with a torch sampler pool (CPU, float32)."""
    server = launch(tmp_path_factory.mktemp("hf-server"), tiny_model_dir, db=14, backend="transformers",
                    sampler=True, env={"OMP_NUM_THREADS": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """One Ray instance on loopback for the whole session (starting Ray costs seconds); its GCS address is
    what launched servers join through `ray.address`."""
    import os

    # before Ray is imported: no token auth, and 127.0.0.1 stays the node address
    # (docs/celery_notes.md#ray-on-a-test-machine)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    ray.init(address="local", num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             namespace="twinkle_cluster", resources={"twinkle_test_node": 4})  # for ray_actor_options tests
    yield str(ray.get_runtime_context().gcs_address)
    ray.shutdown()


@pytest.fixture
def redis_keys() -> Iterator[tuple[redis.Redis, Keys]]:
    """Real Redis (db 1, shared by unit tests) under a key prefix of the test's own, removed afterwards."""
    require_redis()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=1)
    keys = Keys(f"test-{uuid.uuid4().hex[:8]}:")
    yield r, keys
    for key in r.scan_iter(match=keys.root + "*"):
        r.delete(key)
    r.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that drives Chromium (`make test SKIP_BROWSER=1` deselects them)."""
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server of the test's own, which it may stop, freeze and start again."""
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def private_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    """A redis-server of the test module's own: kombu's queues and `unacked` hash have no key prefix, so tests of
    them never use the shared Redis."""
    server = PrivateRedis(tmp_path_factory.mktemp("private-redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def private_client(private_broker: PrivateRedis) -> Iterator[redis.Redis]:
    """A client of `private_broker`, whose data is emptied first."""
    client = redis.Redis(port=private_broker.port)
    client.flushdb()
    yield client
    client.close()


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with the session's status once every result is reported, skipping the interpreter's finalization.

    The suite leaves daemon threads of libraries behind: the Tinker SDK's client thread keeps retrying heartbeats
    to servers the tests stopped, Celery and Ray keep theirs. Finalizing the interpreter under them crashed once in
    a full run (SIGABRT after "1896 passed"), which turned a green run red without any test having failed. The
    crash had the signature later traced to the SDK's pyqwest transport (Rust threads re-entering Python while it
    finalizes), which Twinkle's /client/config now turns off (api/sdk_flags.py); any other library thread
    that does the same would end the run the same way, so the suite still leaves without finalizing."""
    if not _EXIT_STATUS:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
