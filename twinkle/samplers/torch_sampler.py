"""The `torch` sampler: one base model, sampler checkpoints loaded as PEFT adapters into an LRU of slots.

Requests naming different adapters run as one batched generation (PEFT mixed-adapter batches); a batch
needing more adapters than there are slots runs in several rounds. `serve` is the continuous form a sampler
pool uses: requests join the running generation between decode steps as long as their adapters and rows
fit, instead of waiting for the whole batch to end. Checkpoints are keyed by path and file stamp, so a
checkpoint rewritten in place is loaded again rather than served stale.

A full-parameter checkpoint (`twinkle.full_checkpoint`: a whole model directory) is served by its own model
(`samplers.full_models`), so its requests never share a batch with the PEFT ones: `sample` runs them as
their own generations, and `serve` runs one more continuous generation per full model, stepped in turn with
the PEFT one, so neither stalls the other.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle.backends.hf.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from twinkle.backends.hf.generation import Decoder, generate
from twinkle.backends.hf.loading import load_base_model
from twinkle.backends.hf.shared_model import BASE_ADAPTER, SharedModel
from twinkle.errors import InvalidRequest, NotFound, TwinkleError
from twinkle.full_checkpoint import is_full_checkpoint
from twinkle.samplers.full_models import FullModels, full_model_name, is_full_model_name
from twinkle.types import ModelInfo, SampleOutput, SampleRequest

log = logging.getLogger("twinkle.sampler")
Job = tuple[SampleRequest, "Future[SampleOutput]"]
PEFT_LANE = ""  # serve's generation over the base model and its adapters; the others are full models' names
ANY_FULL = "*"  # in `_admit`'s closed lanes: no full model may start, so the running ones can end and free room


@dataclass
class _Lane:
    """One continuous generation of `serve`, with the futures of its requests by request index."""

    decoder: Decoder
    running: dict[int, Future[SampleOutput]] = field(default_factory=dict)


@dataclass
class _Admission:
    """What `_admit` lets into one lane this time, and what the lane then holds."""

    rows: int
    adapters: set[str]
    jobs: list[tuple[str | None, SampleRequest, Future[SampleOutput]]] = field(default_factory=list)


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
        max_full_models: int = 1,
        trust_remote_code: bool | None = None,
    ) -> None:
        """`max_full_models`: full-parameter checkpoints kept loaded, each as large as the base model."""
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
        self.full_models = FullModels(base, max_full_models)

    @classmethod
    def sharing(cls, backend: Any, *, max_loras: int = 4, max_batch_rows: int = 64,
                max_full_models: int = 1) -> TorchSampler:
        """A sampler on the base model a TransformersBackend already holds (no second copy).

        A model pool without a sampler pool uses it to serve sampler checkpoints: their adapters are
        loaded next to the training adapters, frozen, under names no tenant can take. A full checkpoint
        is loaded as a model of its own, never into the backend's.
        """
        if max_loras < 1 or max_batch_rows < 1:
            raise InvalidRequest(f"max_loras and max_batch_rows must be at least 1, got {max_loras}, {max_batch_rows}.")
        sampler = cls.__new__(cls)
        sampler.shared = backend.shared
        sampler.info = backend.info
        sampler.max_loras = max_loras
        sampler.max_batch_rows = max_batch_rows
        sampler._loaded = OrderedDict()
        sampler.full_models = FullModels(backend.shared.base, max_full_models)
        return sampler

    @property
    def loaded_adapters(self) -> list[str]:
        return list(self._loaded)

    @property
    def loaded_full_models(self) -> list[str]:
        """Names of the full checkpoints held in memory, least recently used first."""
        return self.full_models.names

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        names = [self._adapter_name(request.adapter_path) for request in requests]
        results: list[SampleOutput | None] = [None] * len(requests)
        for indices in self._rounds(names, requests):
            round_names = [names[index] for index in indices]
            round_requests = [requests[index] for index in indices]
            if is_full_model_name(round_names[0]):  # a round is all one full model, or none
                model = self.full_models.get(round_names[0], Path(str(round_requests[0].adapter_path)))
                outputs = generate(model, round_requests, None)
            else:
                for name, request in zip(round_names, round_requests, strict=True):
                    if name != BASE_ADAPTER:
                        self._ensure_loaded(name, Path(str(request.adapter_path)), keep=set(round_names))
                outputs = generate(self.shared, round_requests, round_names)
            for index, output in zip(indices, outputs, strict=True):
                results[index] = output
        return [result for result in results if result is not None]

    def serve(self, take: Callable[[], list[Job]]) -> None:
        """Generate for the jobs `take` hands out until none is running or waiting, admitting new ones
        between decode steps. Every job's future ends with its output or its own error.

        Requests for full checkpoints run in a generation of their own per model (a lane), stepped in turn
        with the base model's, so a long full-model generation neither waits for the running one nor
        stalls it (running it to its end between two admissions would freeze every other stream as long).
        """
        lanes = {PEFT_LANE: _Lane(Decoder(self.shared))}
        waiting = take()
        try:
            while waiting or any(lane.decoder.rows_running for lane in lanes.values()):
                waiting = self._admit(lanes, waiting)
                for key, lane in list(lanes.items()):
                    _step(lane)
                    if key != PEFT_LANE and not lane.decoder.rows_running and not lane.running:
                        del lanes[key]  # its model may now be evicted for another
                waiting += take()
        finally:
            running = [future for lane in lanes.values() for future in lane.running.values()]
            for future in [*running, *(future for _, future in waiting)]:
                if not future.done():
                    future.set_exception(RuntimeError("the sampler stopped before this request finished"))

    def _admit(self, lanes: dict[str, _Lane], waiting: list[Job]) -> list[Job]:
        """Join waiting jobs to their lanes while their rows and adapters (or full model) fit; returns the rest.

        Within a lane jobs join in arrival order: once one must wait, the later ones wait behind it. One that
        waits for room to load its full model keeps every full model's lane closed, so the running ones end."""
        admissions: dict[str, _Admission] = {}
        closed: set[str] = {key for key, lane in lanes.items() if not lane.decoder.can_join}
        held: list[Job] = []
        for request, future in waiting:
            try:
                name = self._adapter_name(request.adapter_path)
            except TwinkleError as error:
                future.set_exception(error)
                continue
            full = is_full_model_name(name)
            key = name if full else PEFT_LANE
            if key in closed or (full and ANY_FULL in closed):
                held.append((request, future))
                continue
            if key not in admissions:
                if full and key not in lanes and not self.full_models.has_room_for(key, busy=lanes):
                    closed.add(ANY_FULL)
                    held.append((request, future))
                    continue
                decoder = lanes[key].decoder if key in lanes else None
                running = {adapter for adapter in decoder.running_adapters() if adapter} if decoder else set()
                admissions[key] = _Admission(decoder.rows_running if decoder else 0, running - {BASE_ADAPTER})
            admission = admissions[key]
            adapters = admission.adapters if full else admission.adapters | ({name} - {BASE_ADAPTER})
            alone = admission.rows == 0 and not admission.jobs  # a request bigger than the limits still runs alone
            too_big = admission.rows + request.num_samples > self.max_batch_rows or len(adapters) > self.max_loras
            if not alone and too_big:
                closed.add(key)
                held.append((request, future))
                continue
            try:
                if full:  # loaded, or marked most recently used
                    model = self.full_models.get(key, Path(str(request.adapter_path)), busy=lanes)
                    if key not in lanes:
                        lanes[key] = _Lane(Decoder(model))
                elif name != BASE_ADAPTER:
                    self._ensure_loaded(name, Path(str(request.adapter_path)), keep=adapters)
            except TwinkleError as error:
                future.set_exception(error)
                continue
            admission.jobs.append((None if full else name, request, future))
            admission.adapters, admission.rows = adapters, admission.rows + request.num_samples
        for key, admission in admissions.items():
            if admission.jobs:
                self._join(lanes[key].decoder, admission.jobs, lanes[key].running)
        return held

    def _join(self, decoder: Decoder, jobs: list[tuple[str | None, SampleRequest, Future[SampleOutput]]],
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
        """Groups of requests, each needing at most max_loras adapters and max_batch_rows rows: consecutive
        ones of the base model and its adapters, then each full model's requests on their own."""
        peft = [index for index, name in enumerate(names) if not is_full_model_name(name)]
        by_model: dict[str, list[int]] = {}
        for index, name in enumerate(names):
            if is_full_model_name(name):
                by_model.setdefault(name, []).append(index)
        return [group for indices in (peft, *by_model.values()) for group in self._batches(indices, names, requests)]

    def _batches(self, indices: list[int], names: list[str], requests: list[SampleRequest]) -> list[list[int]]:
        """Consecutive groups of `indices` needing at most max_loras adapters and max_batch_rows rows each."""
        rounds: list[list[int]] = []
        adapters: set[str] = set()
        rows = 0
        for index in indices:
            name, request = names[index], requests[index]
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
        if is_full_checkpoint(directory):
            return full_model_name(directory)
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


def _step(lane: _Lane) -> None:
    """One decode step of the lane; its finished jobs get their outputs, a failed step fails its jobs only."""
    decoder, running = lane.decoder, lane.running
    try:
        decoder.step()
    except Exception as error:  # the running jobs fail with it; the pool goes on
        log.exception("a decode step failed; failing its %d requests", len(running))
        for index in decoder.fail_all():
            running.pop(index).set_exception(error)
    for index in decoder.take_finished():
        running.pop(index).set_result(decoder.pop(index))
    _report_progress(decoder, running)


def _report_progress(decoder: Decoder, running: dict[int, Future[SampleOutput]]) -> None:
    """Hand each running job that asked for it (a `progress` callable on its future) its tokens so far."""
    for index, future in running.items():
        progress = getattr(future, "progress", None)
        if progress is not None:
            try:
                progress(decoder.partial(index))
            except Exception:
                log.warning("a streaming update failed", exc_info=True)
