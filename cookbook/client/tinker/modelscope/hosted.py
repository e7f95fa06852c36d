"""What the modelscope/ examples share: a hosted Twinkle server's address and token from the environment,
and the self_host example each of them runs with hosted defaults (the training code is not copied).

    export TWINKLE_SERVER_URL=<the hosted server's address>
    export MODELSCOPE_TOKEN=<your ModelScope access token>   # or TWINKLE_SERVER_TOKEN
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from twinkle_client.example_connection import server_messages

HOSTED_MODEL = os.environ.get("TWINKLE_BASE_MODEL", "Qwen/Qwen3.5-4B")


def server_url() -> str:
    url = os.environ.get("TWINKLE_SERVER_URL")
    if not url:
        raise SystemExit("Set TWINKLE_SERVER_URL to the hosted Twinkle server's address (https://...).")
    return url


def server_token() -> str:
    token = os.environ.get("MODELSCOPE_TOKEN") or os.environ.get("TWINKLE_SERVER_TOKEN")
    if not token:
        raise SystemExit(
            "Set MODELSCOPE_TOKEN (or TWINKLE_SERVER_TOKEN) to your access token for the server."
        )
    return token


def self_host_example(name: str) -> ModuleType:
    """The self_host example `name`, loaded from its file (the folders are not packages)."""
    path = Path(__file__).resolve().parents[1] / "self_host" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"self_host_{name}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"Cannot load {path}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def run_hosted(name: str, **overrides: Any) -> None:
    """Run the self_host example `name` on the hosted server: its Config defaults with the server's address and
    token and `overrides` (the hosted model, dataset, learning rate...), the server's refusals as one line."""
    with server_messages():
        example = self_host_example(name)
        example.main(defaults=replace(example.Config(), base_url=server_url(), api_key=server_token(), **overrides))
