"""The `torch` sampler: one base model, sampler checkpoints loaded as PEFT adapters into an LRU of slots.

Requests naming different adapters run as one batched generation (PEFT mixed-adapter batches); a batch
needing more adapters than there are slots runs in several rounds. `serve` is the continuous form a sampler
pool uses: requests join the running generation between decode steps as long as their adapters and rows
fit, instead of waiting for the whole batch to end. Checkpoints are keyed by path and file stamp, so a
checkpoint rewritten in place is loaded again rather than served stale.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from twinkle.backends.hf.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from twinkle.backends.hf.generation import Decoder, generate
from twinkle.backends.hf.loading import load_base_model
from twinkle.backends.hf.shared_model import BASE_ADAPTER, SharedModel
from twinkle.errors import InvalidRequest, NotFound, TwinkleError
from twinkle.types import ModelInfo, SampleOutput, SampleRequest

log = logging.getLogger("twinkle.sampler")
Job = tuple[SampleRequest, "Future[SampleOutput]"]


class TorchSampler:
    """Implements `twinkle.backends.base.SamplerBackend` with transformers + PEFT."""

    def __init__(
        self,
        model_id: str,
        *,
        max_loras: int = 4,
        torch_dtype: str = "auto",
        device: str | None = None,
        max_length: int | None = None,
        max_batch_rows: int = 64,
        trust_remote_code: bool | None = None,
    ) -> None:
        if max_loras < 1 or max_batch_rows < 1:
            raise InvalidRequest(f"max_loras and max_batch_rows must be at least 1, got {max_loras}, {max_batch_rows}.")
        base = load_base_model(
            model_id,
            torch_dtype=torch_dtype,
            device=device,
            trust_remote_code_flag=trust_remote_code,
            max_length=max_length,
        )
        self.shared = SharedModel(base)
        self.info: ModelInfo = base.info
        self.max_loras = max_loras
        self.max_batch_rows = max_batch_rows
        self._loaded: OrderedDict[str, None] = OrderedDict()  # adapter names, least recently used first

    @classmethod
    def sharing(cls, backend: Any, *, max_loras: int = 4, max_batch_rows: int = 64) -> TorchSampler:
        """A sampler on the base model a TransformersBackend already holds (no second copy).

        A model pool without a sampler pool uses it to serve sampler checkpoints: their adapters are
        loaded next to the training adapters, frozen, under names no tenant can take.
        """
        sampler = cls.__new__(cls)
        sampler.shared = backend.shared
        sampler.info = backend.info
        sampler.max_loras = max_loras
        sampler.max_batch_rows = max_batch_rows
        sampler._loaded = OrderedDict()
        return sampler

    @property
    def loaded_adapters(self) -> list[str]:
        return list(self._loaded)

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        names = [self._adapter_name(request.adapter_path) for request in requests]
        results: list[SampleOutput | None] = [None] * len(requests)
        for indices in self._rounds(names, requests):
            round_names = [names[index] for index in indices]
            for name, request_index in zip(round_names, indices, strict=True):
                if name != BASE_ADAPTER:
                    self._ensure_loaded(name, Path(str(requests[request_index].adapter_path)), keep=set(round_names))
            outputs = generate(self.shared, [requests[index] for index in indices], round_names)
            for index, output in zip(indices, outputs, strict=True):
                results[index] = output
        return [result for result in results if result is not None]

    def serve(self, take: Callable[[], list[Job]]) -> None:
        """Generate for the jobs `take` hands out until none is running or waiting, admitting new ones
        between decode steps. Every job's future ends with its output or its own error."""
        decoder = Decoder(self.shared)
        running: dict[int, Future[SampleOutput]] = {}
        waiting = take()
        try:
            while waiting or decoder.rows_running:
                waiting = self._admit(decoder, waiting, running)
                try:
                    decoder.step()
                except Exception as error:  # the running jobs fail with it; the pool goes on
                    log.exception("a decode step failed; failing its %d requests", len(running))
                    for index in decoder.fail_all():
                        running.pop(index).set_exception(error)
                for index in decoder.take_finished():
                    running.pop(index).set_result(decoder.pop(index))
                _report_progress(decoder, running)
                waiting += take()
        finally:
            for future in [*running.values(), *(future for _, future in waiting)]:
                if not future.done():
                    future.set_exception(RuntimeError("the sampler stopped before this request finished"))

    def _admit(self, decoder: Decoder, waiting: list[Job], running: dict[int, Future[SampleOutput]]) -> list[Job]:
        """Join waiting jobs, in order, while their rows and adapters fit beside the running ones."""
        if not decoder.can_join:
            return waiting
        in_use = {name for name in decoder.running_adapters() if name and name != BASE_ADAPTER}
        rows = decoder.rows_running
        admitted: list[tuple[str, SampleRequest, Future[SampleOutput]]] = []
        for position, (request, future) in enumerate(waiting):
            try:
                name = self._adapter_name(request.adapter_path)
            except TwinkleError as error:
                future.set_exception(error)
                continue
            adapters = in_use | ({name} - {BASE_ADAPTER})
            alone = rows == 0 and not admitted  # a request bigger than the limits still runs, by itself
            if not alone and (rows + request.num_samples > self.max_batch_rows or len(adapters) > self.max_loras):
                waiting = waiting[position:]
                break
            try:
                if name != BASE_ADAPTER:
                    self._ensure_loaded(name, Path(str(request.adapter_path)), keep=adapters)
            except TwinkleError as error:
                future.set_exception(error)
                continue
            admitted.append((name, request, future))
            in_use, rows = adapters, rows + request.num_samples
        else:
            waiting = []
        if admitted:
            self._join(decoder, admitted, running)
        return waiting

    def _join(self, decoder: Decoder, jobs: list[tuple[str, SampleRequest, Future[SampleOutput]]],
              running: dict[int, Future[SampleOutput]]) -> None:
        try:
            indices = decoder.add([request for _, request, _ in jobs], [name for name, _, _ in jobs])
        except Exception as error:  # noqa: BLE001 - one bad request must not fail the others: join one by one
            if len(jobs) == 1:
                jobs[0][2].set_exception(error)
                return
            for job in jobs:
                self._join(decoder, [job], running)
            return
        running.update(zip(indices, (future for _, _, future in jobs), strict=True))

    def _rounds(self, names: list[str], requests: list[SampleRequest]) -> list[list[int]]:
        """Consecutive groups of requests needing at most max_loras adapters and max_batch_rows rows each."""
        rounds: list[list[int]] = []
        adapters: set[str] = set()
        rows = 0
        for index, (name, request) in enumerate(zip(names, requests, strict=True)):
            new_adapter = name != BASE_ADAPTER and name not in adapters
            too_many = new_adapter and len(adapters) >= self.max_loras
            if not rounds or too_many or rows + request.num_samples > self.max_batch_rows:
                rounds.append([])
                adapters, rows = set(), 0
            rounds[-1].append(index)
            rows += request.num_samples
            if name != BASE_ADAPTER:
                adapters.add(name)
        return rounds

    def _adapter_name(self, adapter_path: str | None) -> str:
        """A PEFT-safe name for the checkpoint at `adapter_path` as it is now on disk."""
        if adapter_path is None:
            return BASE_ADAPTER
        directory = Path(adapter_path)
        weights = directory / ADAPTER_WEIGHTS
        if not (weights.is_file() and (directory / ADAPTER_CONFIG).is_file()):
            raise NotFound(
                f"Sampler weights {directory.name} were not found.",
                hint="Save them with save_weights_for_sampler first, or check the checkpoint path.",
            )
        stamp = weights.stat()
        key = f"{directory.resolve()}|{stamp.st_mtime_ns}|{stamp.st_size}"
        return "sampler_" + hashlib.sha256(key.encode()).hexdigest()[:16]

    def _ensure_loaded(self, name: str, directory: Path, *, keep: set[str]) -> None:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        while len(self._loaded) >= self.max_loras:
            evicted = next(loaded for loaded in self._loaded if loaded not in keep)
            del self._loaded[evicted]
            self.shared.delete_adapter(evicted)
        try:
            self.shared.load_adapter(name, directory)
        except (RuntimeError, ValueError, KeyError) as error:  # shapes or modules of another base model
            raise InvalidRequest(
                f"Sampler weights {directory.name} do not fit {self.info.model_name}: {type(error).__name__}.",
                hint="Sample with the base model the adapter was trained on.",
            ) from error
        self._loaded[name] = None


def _report_progress(decoder: Decoder, running: dict[int, Future[SampleOutput]]) -> None:
    """Hand each running job that asked for it (a `progress` callable on its future) its tokens so far."""
    for index, future in running.items():
        progress = getattr(future, "progress", None)
        if progress is not None:
            try:
                progress(decoder.partial(index))
            except Exception:
                log.warning("a streaming update failed", exc_info=True)
