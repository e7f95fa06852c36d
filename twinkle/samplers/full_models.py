"""Full-parameter sampler checkpoints the torch sampler holds in memory, least recently used first.

A full checkpoint (`twinkle.full_checkpoint`) is a whole model directory, so it cannot join the base model's
PEFT adapters: it is loaded as a second model beside the base, of the same class, dtype and device, sharing
the base's tokenizer, EOS ids and context length (a full run trains the base's weights, never its vocabulary).
Each is named by its resolved path and the stamps of its files, so a checkpoint rewritten in place gets a
new name and is loaded again, as adapters are. At most `capacity` stay loaded: each holds as much memory as
the base model itself.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from twinkle.backends.hf.loading import BaseModel
from twinkle.backends.hf.shared_model import SharedModel
from twinkle.errors import InvalidRequest, NotFound

log = logging.getLogger("twinkle.sampler")
FULL_PREFIX = "full_"  # never a PEFT adapter name (those start with "sampler_")
CONFIG = "config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# What a reload must notice: the weights, their shard index, the config and the marker.
STAMPED_SUFFIXES = (*WEIGHT_SUFFIXES, ".json")


def full_model_name(directory: Path) -> str:
    """A name for the full checkpoint at `directory` as it is on disk now: its resolved path and file stamps."""
    missing = NotFound(
        f"Sampler weights {directory.name} were not found: the full checkpoint has no config or weights.",
        hint="Save them with save_weights_for_sampler first, or check the checkpoint path.",
    )
    try:
        files = sorted(path for path in directory.iterdir() if path.name.endswith(STAMPED_SUFFIXES) and path.is_file())
        stamps = [f"{path.name}:{stat.st_mtime_ns}:{stat.st_size}" for path in files for stat in [path.stat()]]
    except OSError as error:  # removed or rewritten while we looked
        raise missing from error
    if CONFIG not in {path.name for path in files} or not any(path.name.endswith(WEIGHT_SUFFIXES) for path in files):
        raise missing
    key = "|".join([str(directory.resolve()), *stamps])
    return FULL_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:16]


def is_full_model_name(name: str) -> bool:
    return name.startswith(FULL_PREFIX)


class FullModels:
    """Loads full checkpoints as models beside `base`; keeps the `capacity` most recently used."""

    def __init__(self, base: BaseModel, capacity: int = 1) -> None:
        if capacity < 1:
            raise InvalidRequest(f"max_full_models must be at least 1, got {capacity}.")
        self.base = base
        self.capacity = capacity
        self._loaded: OrderedDict[str, SharedModel] = OrderedDict()  # least recently used first

    @property
    def names(self) -> list[str]:
        return list(self._loaded)

    def has_room_for(self, name: str, *, busy: Collection[str] = ()) -> bool:
        """Whether `name` is loaded or could be without evicting a model in `busy` (one generating now)."""
        return name in self._loaded or len(self._loaded) < self.capacity or any(
            loaded not in busy for loaded in self._loaded)

    def get(self, name: str, directory: Path, *, busy: Collection[str] = ()) -> SharedModel:
        """The model `name` (from `full_model_name(directory)`), loaded first if it is not already.

        Models in `busy` are never evicted for it; the caller checks `has_room_for` first."""
        model = self._loaded.get(name)
        if model is not None:
            self._loaded.move_to_end(name)
            return model
        if not self.has_room_for(name, busy=busy):
            raise RuntimeError(f"no room for full model {name}: every loaded one is busy")
        while len(self._loaded) >= self.capacity:
            self._evict(next(loaded for loaded in self._loaded if loaded not in busy))
        model = SharedModel(self._load(directory))
        self._loaded[name] = model
        log.info("loaded full checkpoint %s as %s", directory, name)
        return model

    def _evict(self, name: str) -> None:
        del self._loaded[name]
        # The model is as large as the base: hand its memory back before the next one loads.
        gc.collect()
        if self.base.device.type == "cuda":
            torch.cuda.empty_cache()

    def _load(self, directory: Path) -> BaseModel:
        self._check_fits(directory)
        base = self.base
        model_class: Any = type(base.model)
        # Loading draws nothing from the global RNG that requests' reproducibility might depend on.
        devices = [base.device] if base.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                model, info = model_class.from_pretrained(
                    directory, dtype=base.model.dtype, device_map={"": str(base.device)}, output_loading_info=True
                )
        except (OSError, RuntimeError, ValueError, KeyError) as error:  # unreadable shards, shapes of another model
            raise self._does_not_fit(directory, type(error).__name__) from error
        missing = sorted(info.get("missing_keys") or []) + [str(key) for key in info.get("mismatched_keys") or []]
        if missing:  # transformers initialized them at random rather than fail: never serve those
            raise InvalidRequest(
                f"Sampler weights {directory.name} (a full checkpoint) are incomplete: {len(missing)} weights are "
                f"missing or of another shape, e.g. {missing[0]}.",
                hint="Save them again with save_weights_for_sampler; a checkpoint being written is complete once "
                "its twinkle_full.json marker is.",
            )
        rows = int(model.get_output_embeddings().weight.shape[0])
        if rows != base.info.vocab_size:
            raise self._does_not_fit(directory, f"an output head of {rows} tokens, not {base.info.vocab_size}")
        model.requires_grad_(False)
        model.eval()
        return replace(base, model=model)

    def _check_fits(self, directory: Path) -> None:
        """Refuse, before reading any weights, a checkpoint of another architecture or vocabulary."""
        try:
            config = json.loads((directory / CONFIG).read_text())
        except (OSError, ValueError) as error:
            raise self._does_not_fit(directory, f"an unreadable {CONFIG}") from error
        base_config = self.base.model.config
        model_type = config.get("model_type")
        if model_type != base_config.model_type:
            raise self._does_not_fit(directory, f"model_type {model_type!r}, not {base_config.model_type!r}")
        text_config = config.get("text_config") or config
        vocab = text_config.get("vocab_size", config.get("vocab_size"))
        base_vocab = base_config.get_text_config().vocab_size
        if vocab != base_vocab:
            raise self._does_not_fit(directory, f"vocab_size {vocab}, not {base_vocab}")

    def _does_not_fit(self, directory: Path, why: str) -> InvalidRequest:
        return InvalidRequest(
            f"Sampler weights {directory.name} (a full checkpoint) do not fit {self.base.info.model_name}: {why}.",
            hint="Sample with the base model the full run was trained from.",
        )
