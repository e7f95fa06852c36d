"""`python -m twinkle.server.flower -c cfg.yaml`: Flower, the Celery monitoring UI, on Twinkle's broker.

`twinkle-server launch` runs it as a supervised child when `flower.enabled` is set, and
`launch --only flower` runs it alone against a shared broker. Tasks appear under their verb
(`twinkle.forward_backward`, `twinkle.sample`, ...) with the model they serve in their kwargs; workers
under their queue (`model.<app>.<replica>@host`). Flower runs inside this process, so the basic-auth
password never appears on a command line that `ps` shows.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from twinkle.celery_app import make_celery
from twinkle.config import load_config

if TYPE_CHECKING:
    from twinkle.config.server_config import ServerConfig

# kwargs carry the request id and the model id; args are always empty and results live in Twinkle's futures.
TASK_COLUMNS = "name,uuid,state,kwargs,received,started,runtime,worker"


def flower_argv(config: ServerConfig) -> list[str]:
    """The `celery flower` arguments for this config."""
    argv = ["flower", f"--port={config.flower.port}", f"--address={config.http_options.host}",
            f"--tasks_columns={TASK_COLUMNS}", "--enable_events=True"]
    if config.flower.basic_auth:
        argv.append(f"--basic-auth={config.flower.basic_auth}")
    return argv


def flower_env(config: ServerConfig) -> dict[str, str]:
    """Flower serves its REST API without credentials only when told to; do so only when no auth is set."""
    return {} if config.flower.basic_auth else {"FLOWER_UNAUTHENTICATED_API": "true"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinkle.server.flower",
                                     description="Run Flower against the broker of a Twinkle server config.")
    parser.add_argument("-c", "--config", default=os.environ.get("TWINKLE_SERVER_CONFIG"))
    ns = parser.parse_args(argv)
    if not ns.config:
        parser.error("no config: pass -c or set TWINKLE_SERVER_CONFIG")
    config = load_config(ns.config)
    url = os.environ.get("TWINKLE_BROKER_URL") or config.broker.url
    if not url:
        parser.error("no broker URL: set broker.url in the config or TWINKLE_BROKER_URL (the launcher does)")
    os.environ.update(flower_env(config))
    host = config.http_options.host
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    guard = "basic auth" if config.flower.basic_auth else "NO AUTH: set flower.basic_auth to protect it"
    print(f"[twinkle] Flower on http://{shown}:{config.flower.port} ({guard})", flush=True)
    return int(make_celery(str(url)).start(flower_argv(config)) or 0)


if __name__ == "__main__":
    sys.exit(main())
