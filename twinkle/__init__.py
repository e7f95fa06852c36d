"""Twinkle: training as a service. Many users train their own LoRA adapters on one hosted base model.

The package root stays light; heavy parts (backends, data library) are imported on use.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> None:
    """Let existing Tinker SDK code talk to a Twinkle server (see twinkle.tinker_patch)."""
    from twinkle.tinker_patch import init_tinker_client as _init

    _init(base_url, api_key)


def get_logger(name: str = "twinkle", level: int | str | None = None) -> logging.Logger:
    """A logger that prints `time level name: message` once configured; safe to call repeatedly."""
    logger = logging.getLogger(name)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level if level is not None else logging.INFO)
    return logger

