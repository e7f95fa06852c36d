"""`python -m api -c cfg.yaml`: run the HTTP API alone (the launcher does this per API process)."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from api import access_log
from api.app import create_app
from twinkle.config import load_config
from twinkle.fd_limit import raise_open_files_limit


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m api")
    parser.add_argument("-c", "--config", default=os.environ.get("TWINKLE_SERVER_CONFIG"))
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    ns = parser.parse_args()
    if not ns.config:
        parser.error("no config: pass -c or set TWINKLE_SERVER_CONFIG")
    config = load_config(ns.config)
    broker = os.environ.get("TWINKLE_BROKER_URL") or config.broker.url
    if not broker:
        parser.error("no broker URL: set broker.url or TWINKLE_BROKER_URL")
    level = os.environ.get("TWINKLE_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    access_log.configure_from_env()
    raise_open_files_limit()  # every pending long-poll is an open socket
    app = create_app(config, broker, long_poll_seconds=float(os.environ.get("TWINKLE_LONG_POLL_SECONDS", "30")))
    uvicorn.run(app, host=ns.host or config.http_options.host, port=ns.port or config.http_options.port,
                log_level="warning", access_log=False, timeout_keep_alive=75,
                backlog=8192)  # thousands of long-polls connect at once; the kernel caps it at somaxconn


if __name__ == "__main__":
    main()
