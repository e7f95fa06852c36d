"""Persistence of the durable part of Twinkle's state (docs/architecture.md#state-and-how-long-it-lives).

Durable: training runs (model records), their checkpoint index, each owner's list of runs, sampling
sessions, and the usage ledger (twinkle/usage.py). Futures, payloads, sessions and queues are transient by design.

- `memory`: kept in the broker's Redis only.
- `file`: an atomic JSON snapshot at `persistence.file_path`, written every few seconds and at
  shutdown by the launcher, restored at launch.
- `redis`: an external Redis at `persistence.redis_url` (possibly the broker) that already keeps it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from twinkle.keys import Keys

if TYPE_CHECKING:
    from twinkle.config.server_config import ServerConfig

DURABLE_PATTERNS = ("model:*", "run:*", "owner:*:runs", "owner:*:sampling", "sampling:*", "usage:*")


def state_url(config: ServerConfig, broker_url: str | None = None) -> str:
    if config.persistence.mode == "redis" and config.persistence.redis_url:
        return str(config.persistence.redis_url)
    url = broker_url or os.environ.get("TWINKLE_BROKER_URL") or config.broker.url
    if not url:
        raise SystemExit(f"No Redis to clear: this config's broker is embedded (no broker.url), and no "
                         f"`twinkle-server launch` of it serving port {config.http_options.port} runs on this "
                         "machine, so its state is gone already. Run this while the server runs, or set "
                         "broker.url / persistence.redis_url.")
    return str(url)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _scan(r: redis.Redis, pattern: str) -> list[bytes]:
    return [k if isinstance(k, bytes) else str(k).encode() for k in r.scan_iter(match=pattern, count=1000)]


def snapshot(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for pattern in DURABLE_PATTERNS:
        for key in _scan(r, keys.root + pattern):
            name = key.decode()
            kind = _text(r.type(key))
            if kind == "hash":
                data[name] = {"hash": {_text(k): _text(v) for k, v in r.hgetall(key).items()}}
            elif kind == "set":
                data[name] = {"set": sorted(_text(m) for m in r.smembers(key))}
    return data


def save_snapshot(r: redis.Redis, keys: Keys, path: str | Path) -> int:
    data = snapshot(r, keys)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".partial")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, target)
    return len(data)


def restore_snapshot(r: redis.Redis, path: str | Path) -> int:
    target = Path(path)
    if not target.exists():
        return 0
    data: dict[str, Any] = json.loads(target.read_text())
    pipe = r.pipeline()
    live = [bool(r.exists(name)) for name in data]
    for (name, value), exists in zip(data.items(), live, strict=True):
        if exists:  # the broker kept it: newer than the snapshot
            continue
        if value.get("hash"):
            pipe.hset(name, mapping=value["hash"])
        elif value.get("set"):
            pipe.sadd(name, *value["set"])
    pipe.execute()
    return len(data)


def clear_persistence(config: ServerConfig, broker_url: str | None = None) -> int:
    """Remove exactly Twinkle's keys (and the snapshot file in file mode); returns keys removed. `broker_url`:
    the running launch's embedded broker, for a config that names none."""
    keys = Keys(config.persistence.key_prefix)
    removed = 0
    if config.persistence.mode == "file" and config.persistence.file_path:
        path = Path(config.persistence.file_path)
        if path.exists():
            removed += len(json.loads(path.read_text()))
            path.unlink()
    try:
        r = redis.Redis.from_url(state_url(config, broker_url))
        for key in _scan(r, keys.root + "*"):
            removed += int(r.delete(key))
    except SystemExit:
        if config.persistence.mode != "file":
            raise
    return removed
