"""The numpy-only model backend: real LoRA training of a tiny bigram language model, for tests and demos.

See `mock_model.py` for the model. Each adapter holds its LoRA weights, accumulated gradients, AdamW
moments, step count and its own RNG (seeded from `LoraSpec.seed`, used for initialisation and LoRA
dropout), so tenants never touch each other's state. The optimizer follows `torch.optim.AdamW` (decoupled
weight decay, bias-corrected moments) and `torch.nn.utils.clip_grad_norm_`; an `optim_step` with no
accumulated gradient leaves everything untouched, as torch does for parameters whose grad is None.
The mock model is text-only and has one LoRA target, so `LoraSpec`'s train_* flags and target_modules
do not change it.

A run created with `LoraSpec(mode="full")` trains all the base model's weights (E, W and b) instead, with
the same AdamW, clipping and metrics, as `hf.full_run` does on the torch backend: at most one per backend,
never paged, and while it lives every LoRA op is refused (PoolReserved) and the adapters wait untouched. It
trains its own copy of the base, so the base stays exactly the original and serves again when the run ends
(the torch backend trains in place and restores from a copy: the same memory, the same result);
`sample(None, ...)` and a forward with `disable_lora` meanwhile use that original. The run's passes use no
LoRA; having no dropout of its own, the mock model applies `LoraSpec.dropout` to the unembedding's input,
drawn from the run's own RNG. Its checkpoints are mock model directories (config.json, tokenizer files, the
weights in `mock_model.BASE_FILE`) marked by `twinkle.full_checkpoint`, plus `FULL_OPTIMIZER_FILE` when
saved with the optimizer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twinkle import losses
from twinkle.backends.data_parallel import GradientReducer
from twinkle.backends.mock_model import (
    ADAPTER_FILE,
    BaseGrads,
    BigramBase,
    LoraGrads,
    LoraWeights,
    TargetPass,
    accumulate_base_gradients,
    accumulate_gradients,
    class_rows,
    load_adapter,
    load_base,
    nonzero_classes,
    read_model_source,
    save_adapter,
    save_base,
    served_base,
    target_logprobs,
)
from twinkle.backends.paging import AdapterPager, PagedAdapter, PagingBudget
from twinkle.errors import InvalidRequest, NotFound, PoolReserved
from twinkle.full_checkpoint import MARKER, is_full_checkpoint, write_marker
from twinkle.losses import ElementwiseLoss
from twinkle.samplers.mock import BigramSampling, NextTokenRows
from twinkle.tokenizer_files import TOKENIZER_FILE_NAMES
from twinkle.types import (
    TRAINING_MODES,
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    ImageChunk,
    LoraSpec,
    SampleOutput,
    SampleRequest,
)

_DEFAULT_ALPHA = 32.0
_ADAM_CHUNK = 1 << 17  # elements per pass: keeps AdamW's temporaries in cache for large vocabularies
_OPTIMIZER_KEYS = ("exp_avg_down", "exp_avg_sq_down", "exp_avg_up", "exp_avg_sq_up", "step", "rng_state")
FULL_OPTIMIZER_FILE = "optimizer.npz"
_FULL_PARAMETERS = ("embeddings", "unembedding", "bias")


@dataclass
class _AdamState:
    exp_avg: LoraGrads
    exp_avg_sq: LoraGrads
    step: int = 0


@dataclass
class _Adapter:
    spec: LoraSpec
    lora: LoraWeights
    rng: np.random.Generator
    optimizer: _AdamState
    grads: LoraGrads  # zero outside `grad_classes` (np.zeros maps untouched pages lazily)
    live_classes: np.ndarray  # bool [C]: token blocks of B that may be non-zero in weights or moments
    grad_classes: np.ndarray  # bool [C]: token blocks with gradient since the last optim_step
    has_grads: bool = False  # a forward_backward ran since the last optim_step

    @classmethod
    def build(
        cls,
        base: BigramBase,
        spec: LoraSpec,
        lora: LoraWeights,
        rng: np.random.Generator,
        optimizer: _AdamState,
    ) -> _Adapter:
        live = nonzero_classes(base, lora.up, optimizer.exp_avg.up, optimizer.exp_avg_sq.up)
        grads = LoraGrads.zeros_like(lora)
        return cls(spec, lora, rng, optimizer, grads, live, np.zeros_like(live))


@dataclass
class _FullRun:
    """A full-parameter run: its own copy of the base model, trained whole."""

    run_id: str
    spec: LoraSpec
    weights: BigramBase
    rng: np.random.Generator
    grads: BaseGrads
    exp_avg: BaseGrads
    exp_avg_sq: BaseGrads
    step: int = 0
    has_grads: bool = False  # a forward_backward ran since the last optim_step

    @classmethod
    def fresh(cls, run_id: str, spec: LoraSpec, weights: BigramBase, rng: np.random.Generator) -> _FullRun:
        zeros = BaseGrads.zeros_like
        return cls(run_id, spec, weights, rng, zeros(weights), zeros(weights), zeros(weights))


class MockBackend:
    """A ModelBackend on a numpy class-factored bigram model (no torch); see the module docstring."""

    def __init__(
        self,
        model_dir_or_vocab: str | int | os.PathLike[str],
        *,
        max_loras: int = 8,
        max_length: int | None = None,
        paging: PagingBudget | None = None,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}.")
        source = read_model_source(model_dir_or_vocab, max_length)
        self.info = source.info
        self.max_loras = max_loras
        self._model_dir = source.directory
        self._base = served_base(source)  # never trained: a full run trains a copy of it
        self._sampling = BigramSampling(self._base, self.info, source.directory)
        self._base_rows = NextTokenRows(self.info.vocab_size)
        self._adapters: dict[str, _Adapter] = {}  # the resident ones; the pager keeps the others
        self._full: _FullRun | None = None  # never paged: the pager holds LoRA adapters only
        self.pager = AdapterPager(self, max_loras, paging or PagingBudget())

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        if self.has_adapter(adapter_id):
            raise InvalidRequest(f"Adapter {adapter_id!r} already exists on this backend.")
        if spec.mode not in TRAINING_MODES:
            raise InvalidRequest(f"Unknown training mode {spec.mode!r}.", hint=f"Choose one of {TRAINING_MODES}.")
        if not spec.full and spec.rank < 1:
            raise InvalidRequest(f"LoRA rank must be at least 1, got {spec.rank}.")
        if spec.seed is not None and spec.seed < 0:
            raise InvalidRequest(f"LoRA seed must be a non-negative integer, got {spec.seed}.")
        if not 0 <= spec.dropout < 1:
            raise InvalidRequest(f"LoRA dropout must be in [0, 1), got {spec.dropout}.")
        if spec.full:
            self._start_full_run(adapter_id, spec)
            return
        self._refuse_while_full_run()
        self.pager.admit(adapter_id)
        rng = np.random.default_rng(_adapter_seed(adapter_id, spec.seed))
        lora = LoraWeights.fresh(self._base, spec.rank, spec.alpha or _DEFAULT_ALPHA, rng)
        optimizer = _AdamState(LoraGrads.zeros_like(lora), LoraGrads.zeros_like(lora))
        self._adapters[adapter_id] = _Adapter.build(self._base, spec, lora, rng, optimizer)
        self.pager.added(adapter_id)

    def _start_full_run(self, run_id: str, spec: LoraSpec) -> None:
        if self._full is not None:
            raise PoolReserved(
                f"Full-parameter run {self._full.run_id} already holds this backend; it takes one at a time.",
                hint="Wait until that run is unloaded, or train this one as a LoRA adapter.",
                holder=self._full.run_id,
            )
        rng = np.random.default_rng(_adapter_seed(run_id, spec.seed))
        self._full = _FullRun.fresh(run_id, spec, self._base.copy(), rng)

    def _refuse_while_full_run(self) -> None:
        if self._full is not None:
            raise PoolReserved(
                f"Full-parameter run {self._full.run_id} holds this backend: its LoRA adapters wait until it ends.",
                hint="Retry once the full-parameter run is unloaded.",
                holder=self._full.run_id,
            )

    def remove_adapter(self, adapter_id: str) -> None:
        """Drop the adapter; for the full run, its trained copy goes and the untouched base serves again."""
        if self._full is not None and self._full.run_id == adapter_id:
            self._full = None
            return
        self.pager.forget(adapter_id)
        self._adapters.pop(adapter_id, None)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.pager or (self._full is not None and self._full.run_id == adapter_id)

    @property
    def full_run(self) -> str | None:
        """The id of the full-parameter run living on this backend, if any."""
        return None if self._full is None else self._full.run_id

    def page_out(self, adapter_id: str) -> PagedAdapter:
        """The adapter's whole state: it already lives in host memory, so paging out moves no bytes here."""
        adapter = self._adapters.pop(adapter_id)
        arrays = [adapter.lora.down, adapter.lora.up, adapter.grads.down, adapter.grads.up,
                  adapter.optimizer.exp_avg.down, adapter.optimizer.exp_avg.up,
                  adapter.optimizer.exp_avg_sq.down, adapter.optimizer.exp_avg_sq.up]
        return PagedAdapter(adapter, sum(int(array.nbytes) for array in arrays))

    def page_in(self, adapter_id: str, paged: PagedAdapter) -> None:
        self._adapters[adapter_id] = paged.state

    def resident_adapters(self) -> list[str]:
        return self.pager.resident_ids()

    def paging_stats(self) -> dict[str, float]:
        return self.pager.stats.as_dict()

    def forward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        run = self._full_run(adapter_id)
        if run is not None:
            return self._run_full(run, batch, train=False)
        return self._run(self._adapter(adapter_id), batch, train=False)

    def forward_backward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        run = self._full_run(adapter_id)
        if run is not None:
            return self._run_full(run, batch, train=True)
        return self._run(self._adapter(adapter_id), batch, train=True)

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        run = self._full_run(adapter_id)
        if run is not None:
            return _full_optim_step(run, params)
        adapter = self._adapter(adapter_id)
        _check_adam_params(params)
        metrics = {"learning_rate:mean": float(params.learning_rate), "grad_norm:mean": 0.0}
        if not adapter.has_grads:
            return metrics
        grads, state, lora = adapter.grads, adapter.optimizer, adapter.lora
        grad_rows = class_rows(self._base, adapter.grad_classes)
        grad_parts = [grads.down, *(grads.up[rows] for rows in grad_rows)]
        norm = math.sqrt(sum(float(np.dot(part.ravel(), part.ravel())) for part in grad_parts))
        metrics["grad_norm:mean"] = norm
        if params.grad_clip_norm > 0:
            clip_coefficient = params.grad_clip_norm / (norm + 1e-6)
            if clip_coefficient < 1:
                for part in grad_parts:
                    part *= np.float32(clip_coefficient)
        state.step += 1
        _adamw(lora.down, grads.down, state.exp_avg.down, state.exp_avg_sq.down, state.step, params)
        for rows in class_rows(self._base, adapter.live_classes):
            up_parts = (lora.up[rows], grads.up[rows], state.exp_avg.up[rows], state.exp_avg_sq.up[rows])
            _adamw(*up_parts, state.step, params)
        for part in grad_parts:
            part.fill(0)
        adapter.grad_classes[:] = False
        adapter.has_grads = False
        return metrics

    def sync_gradients(self, adapter_id: str, reducer: GradientReducer) -> None:
        """Sum the adapter's accumulated gradients over the data-parallel ranks (backends.data_parallel), in
        one all-reduce; the token blocks with gradient become the union of every rank's."""
        run = self._full_run(adapter_id)
        if run is not None:
            flag = np.array([run.has_grads], np.float32)
            reducer.sum_([flag, *run.grads.arrays()])
            run.has_grads = bool(flag[0] > 0)
            return
        adapter = self._adapter(adapter_id)
        counts = np.concatenate([[np.float32(adapter.has_grads)], adapter.grad_classes.astype(np.float32)])
        reducer.sum_([counts, adapter.grads.down, adapter.grads.up])
        if counts[0] == 0:
            return  # no rank accumulated anything: the sum left the zero gradients as they were
        touched = counts[1:] > 0
        adapter.grad_classes[:] = touched
        adapter.live_classes |= touched
        adapter.has_grads = True

    def save_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        run = self._full_run(adapter_id)
        if run is not None:
            self._save_full(run, Path(directory), include_optimizer=include_optimizer)
            return
        adapter = self._adapter(adapter_id)
        extra: dict[str, np.ndarray] = {}
        if include_optimizer:
            state = adapter.optimizer
            extra = {
                "exp_avg_down": state.exp_avg.down,
                "exp_avg_sq_down": state.exp_avg_sq.down,
                "exp_avg_up": state.exp_avg.up,
                "exp_avg_sq_up": state.exp_avg_sq.up,
                "step": np.array(state.step),
                "rng_state": np.array(json.dumps(adapter.rng.bit_generator.state)),
            }
        save_adapter(Path(directory), self._base, adapter.lora, extra)

    def load_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        """Replace the adapter's weights; with `include_optimizer` also its AdamW moments, step count and
        RNG, otherwise the optimizer restarts from zero. Unapplied gradients are dropped either way."""
        run = self._full_run(adapter_id)
        if run is not None:
            self._load_full(run, Path(directory), include_optimizer=include_optimizer)
            return
        adapter = self._adapter(adapter_id)
        if is_full_checkpoint(Path(directory)):
            raise InvalidRequest(
                f"{Path(directory).name} is a full-parameter checkpoint (a whole model, written by a full run), "
                "not a LoRA adapter.",
                hint="Create a full-parameter model (mode='full') and load it there.",
            )
        lora, extra = load_adapter(Path(directory), self._base)
        if lora.rank != adapter.lora.rank:
            raise InvalidRequest(
                f"The checkpoint has LoRA rank {lora.rank} but adapter {adapter_id!r} has rank "
                f"{adapter.lora.rank}.",
                hint="Create the model with the checkpoint's rank before loading it.",
            )
        if include_optimizer and not all(key in extra for key in _OPTIMIZER_KEYS):
            raise InvalidRequest(
                "This checkpoint holds weights only, without optimizer state.",
                hint="Load it without the optimizer, or save with save_state to keep the optimizer.",
            )
        if include_optimizer:
            optimizer = _AdamState(
                LoraGrads(extra["exp_avg_down"], extra["exp_avg_up"]),
                LoraGrads(extra["exp_avg_sq_down"], extra["exp_avg_sq_up"]),
                int(extra["step"]),
            )
            adapter.rng.bit_generator.state = json.loads(str(extra["rng_state"]))
        else:
            optimizer = _AdamState(LoraGrads.zeros_like(lora), LoraGrads.zeros_like(lora))
        self._adapters[adapter_id] = _Adapter.build(self._base, adapter.spec, lora, adapter.rng, optimizer)

    def save_weights_for_sampler(self, adapter_id: str, directory: Path) -> None:
        run = self._full_run(adapter_id)
        if run is not None:
            self._save_full(run, Path(directory), include_optimizer=False)
            return
        save_adapter(Path(directory), self._base, self._adapter(adapter_id).lora, {})

    def sample(self, adapter_id: str | None, requests: list[SampleRequest]) -> list[SampleOutput]:
        run = None if adapter_id is None else self._full_run(adapter_id)
        if run is not None:
            return [self._sampling.sample(None, request, base=run.weights) for request in requests]
        if adapter_id is None:  # the served base never changes: its rows are kept
            return [self._sampling.sample(None, request, rows=self._base_rows) for request in requests]
        lora = self._adapter(adapter_id).lora  # trained in place: computed in full every time
        return [self._sampling.sample(lora, request) for request in requests]

    def _full_run(self, adapter_id: str) -> _FullRun | None:
        return self._full if self._full is not None and self._full.run_id == adapter_id else None

    def _save_full(self, run: _FullRun, directory: Path, *, include_optimizer: bool) -> None:
        """A mock model directory of the run's weights (usable as a model itself), marked as a full checkpoint;
        with `include_optimizer` also the AdamW moments, step count and RNG, so a resume is bit-exact."""
        self._write_model_files(directory)
        save_base(directory, run.weights)
        if include_optimizer:
            arrays = {"step": np.array(run.step), "rng_state": np.array(json.dumps(run.rng.bit_generator.state))}
            for moment, state in (("exp_avg", run.exp_avg), ("exp_avg_sq", run.exp_avg_sq)):
                names = (f"{moment}_{parameter}" for parameter in _FULL_PARAMETERS)
                arrays |= dict(zip(names, state.arrays(), strict=True))
            with open(directory / FULL_OPTIMIZER_FILE, "wb") as handle:
                np.savez(handle, allow_pickle=False, **arrays)
        else:
            (directory / FULL_OPTIMIZER_FILE).unlink(missing_ok=True)  # a directory rewritten in place: no stale state
        write_marker(directory, base_model=self.info.model_name, steps=run.step, include_optimizer=include_optimizer)

    def _write_model_files(self, directory: Path) -> None:
        """The served model's config.json and tokenizer files, so the checkpoint is a model directory too."""
        if self._model_dir is None:
            (directory / "config.json").write_text(json.dumps({"vocab_size": self.info.vocab_size}))
            return
        for name in TOKENIZER_FILE_NAMES:  # config.json among them
            if (self._model_dir / name).is_file():
                shutil.copyfile(self._model_dir / name, directory / name)

    def _load_full(self, run: _FullRun, directory: Path, *, include_optimizer: bool) -> None:
        """Replace the run's weights; with `include_optimizer` also its AdamW moments, step count and RNG,
        otherwise the optimizer restarts from zero. Unapplied gradients are dropped either way."""
        if not is_full_checkpoint(directory) and (directory / ADAPTER_FILE).is_file():
            raise InvalidRequest(
                f"{directory.name} is a LoRA adapter checkpoint, and this model is a full-parameter run.",
                hint="Create a LoRA model (mode='lora') with the checkpoint's rank and load it there.",
            )
        if not is_full_checkpoint(directory):
            raise InvalidRequest(
                f"{directory.name} is not a full-parameter checkpoint: {MARKER} is missing.",
                hint="Pass a path written by save_state or save_weights_for_sampler of a full-parameter run.",
            )
        weights = load_base(directory, self.info.vocab_size)
        if weights.embeddings.shape != run.weights.embeddings.shape:
            raise InvalidRequest(f"{directory.name} holds a model of another shape than this backend's.")
        loaded = _FullRun.fresh(run.run_id, run.spec, weights, run.rng)
        if include_optimizer:
            path = directory / FULL_OPTIMIZER_FILE
            if not path.is_file():
                raise InvalidRequest(
                    "This checkpoint holds weights only, without optimizer state.",
                    hint="Load it without the optimizer, or save with save_state to keep the optimizer.",
                )
            with np.load(path, allow_pickle=False) as stored:
                state = {key: stored[key] for key in stored.files}
            loaded.exp_avg = BaseGrads(*(state[f"exp_avg_{parameter}"] for parameter in _FULL_PARAMETERS))
            loaded.exp_avg_sq = BaseGrads(*(state[f"exp_avg_sq_{parameter}"] for parameter in _FULL_PARAMETERS))
            loaded.step = int(state["step"])
            run.rng.bit_generator.state = json.loads(str(state["rng_state"]))
        self._full = loaded

    def _run_full(self, run: _FullRun, batch: ForwardBackwardInput, *, train: bool) -> ForwardBackwardOutput:
        # disable_lora scores with the original base: the reference a full run's KL terms want.
        weights = self._base if batch.disable_lora and not train else run.weights
        forward, result, shapes = self._score(weights, None, batch, run.rng, run.spec.dropout if train else 0.0)
        if train:
            accumulate_base_gradients(run.weights, forward, result.dloss_dlp, run.grads)
            run.has_grads = True
        return _outputs(forward, result, shapes)

    def _adapter(self, adapter_id: str) -> _Adapter:
        self._refuse_while_full_run()
        self.pager.use(adapter_id)
        adapter = self._adapters.get(adapter_id)
        if adapter is None:
            raise NotFound(f"No adapter {adapter_id!r} is loaded on this backend.")
        return adapter

    def _run(self, adapter: _Adapter, batch: ForwardBackwardInput, *, train: bool) -> ForwardBackwardOutput:
        lora = None if batch.disable_lora and not train else adapter.lora
        dropout = adapter.spec.dropout if train else 0.0
        forward, result, shapes = self._score(self._base, lora, batch, adapter.rng, dropout)
        if train:
            accumulate_gradients(self._base, adapter.lora, forward, result.dloss_dlp, adapter.grads)
            touched = forward.classes(self._base.num_classes)
            adapter.grad_classes |= touched
            adapter.live_classes |= touched
            adapter.has_grads = True
        return _outputs(forward, result, shapes)

    def _score(
        self,
        base: BigramBase,
        lora: LoraWeights | None,
        batch: ForwardBackwardInput,
        rng: np.random.Generator,
        dropout: float,
    ) -> tuple[TargetPass, ElementwiseLoss, list[tuple[int, ...]]]:
        """The batch's target logprobs and loss, with dropout masks drawn from `rng` when `dropout` > 0."""
        losses.validate_loss(batch.loss_fn, batch.data, batch.loss_fn_config)
        self._check_tokens(batch.data)
        prev, target, inputs, target_shapes = _flatten(batch)
        mask = None
        if dropout > 0:
            keep = rng.random((len(prev), base.dim)) >= dropout
            mask = keep.astype(np.float32) / np.float32(1 - dropout)
        forward = target_logprobs(base, lora, prev, target, mask)
        result = losses.elementwise_loss_and_grad(
            batch.loss_fn, forward.logprobs, inputs, batch.loss_fn_config,
            segments=[math.prod(shape) for shape in target_shapes],
        )
        return forward, result, target_shapes

    def _check_tokens(self, data: list[Datum]) -> None:
        vocab = self.info.vocab_size
        limit = self.info.max_context_length
        problems = []
        for index, datum in enumerate(data):
            if any(isinstance(chunk, ImageChunk) for chunk in datum.model_input):
                problems.append(f"datum {index} has an image, but the mock model reads text only")
                continue
            tokens = datum.tokens()
            if len(tokens) > limit:
                problems.append(f"datum {index} has {len(tokens)} tokens, over this model's limit of {limit}")
            targets = np.asarray(datum.loss_fn_inputs["target_tokens"])
            for name, ids in (("model_input", tokens), ("target_tokens", targets)):
                if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                    problems.append(f"datum {index}: {name} has token ids outside [0, {vocab})")
        if problems:
            raise InvalidRequest("; ".join(problems[:10]) + ".", hint="Shorten or fix the listed datums.")


def _outputs(
    forward: TargetPass, result: ElementwiseLoss, target_shapes: list[tuple[int, ...]]
) -> ForwardBackwardOutput:
    metrics = {"loss:sum": float(result.loss.sum(dtype=np.float64)), **result.metrics}
    outputs = []
    offset = 0
    for shape in target_shapes:
        size = math.prod(shape)
        outputs.append(
            {
                "logprobs": forward.logprobs[offset : offset + size].reshape(shape),
                "elementwise_loss": result.loss[offset : offset + size].astype(np.float32).reshape(shape),
            }
        )
        offset += size
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)


def _full_optim_step(run: _FullRun, params: AdamParams) -> dict[str, float]:
    """The adapters' optimizer on every weight of the model: norm, clip, one AdamW step, zero the grads."""
    _check_adam_params(params)
    metrics = {"learning_rate:mean": float(params.learning_rate), "grad_norm:mean": 0.0}
    if not run.has_grads:
        return metrics
    grads = run.grads.arrays()
    norm = math.sqrt(sum(float(np.dot(grad.ravel(), grad.ravel())) for grad in grads))
    metrics["grad_norm:mean"] = norm
    if params.grad_clip_norm > 0:
        clip_coefficient = params.grad_clip_norm / (norm + 1e-6)
        if clip_coefficient < 1:
            for grad in grads:
                grad *= np.float32(clip_coefficient)
    run.step += 1
    parts = zip(run.weights.parameters(), grads, run.exp_avg.arrays(), run.exp_avg_sq.arrays(), strict=True)
    for weights, grad, exp_avg, exp_avg_sq in parts:
        _adamw(weights, grad, exp_avg, exp_avg_sq, run.step, params)
        grad.fill(0)
    run.weights.mask_padding()
    run.has_grads = False
    return metrics


def _flatten(
    batch: ForwardBackwardInput,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], list[tuple[int, ...]]]:
    """Concatenate the batch into (prev, target) rows; [T, K] targets become T·K rows sharing their prev."""
    prevs, targets, shapes = [], [], []
    inputs: dict[str, list[np.ndarray]] = {}
    for datum in batch.data:
        resolved = losses.loss_inputs(batch.loss_fn, datum.loss_fn_inputs)
        target = np.asarray(resolved["target_tokens"], dtype=np.int64)
        per_position = math.prod(target.shape[1:])
        prevs.append(np.repeat(datum.tokens(), per_position))
        targets.append(target.ravel())
        shapes.append(target.shape)
        for key, value in resolved.items():
            if key != "target_tokens":
                inputs.setdefault(key, []).append(np.asarray(value, np.float32).ravel())
    flat_inputs = {key: np.concatenate(values) for key, values in inputs.items()}
    flat_inputs["target_tokens"] = np.concatenate(targets)
    return np.concatenate(prevs), flat_inputs["target_tokens"], flat_inputs, shapes


def _adamw(
    weights: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    step: int,
    params: AdamParams,
) -> None:
    """One torch.optim.AdamW step, in place, in cache-sized chunks."""
    decay = np.float32(1 - params.learning_rate * params.weight_decay)
    beta1, beta2 = np.float32(params.beta1), np.float32(params.beta2)
    bias_correction2_sqrt = np.float32(math.sqrt(1 - params.beta2**step))
    step_size = np.float32(params.learning_rate / (1 - params.beta1**step))
    eps = np.float32(params.eps)
    arrays = (weights, grad, exp_avg, exp_avg_sq)
    assert all(array.flags.c_contiguous for array in arrays)  # reshape must give views, not copies
    flat = [array.reshape(-1) for array in arrays]
    scratch = np.empty(min(_ADAM_CHUNK, flat[0].size), np.float32)
    denom = np.empty_like(scratch)
    for start in range(0, flat[0].size, _ADAM_CHUNK):
        w, g, m, v = (array[start : start + _ADAM_CHUNK] for array in flat)
        tmp, den = scratch[: len(w)], denom[: len(w)]
        if params.weight_decay:
            w *= decay
        np.subtract(g, m, out=tmp)  # exp_avg.lerp_(grad, 1 - beta1)
        tmp *= 1 - beta1
        m += tmp
        v *= beta2
        np.multiply(g, g, out=tmp)
        tmp *= 1 - beta2
        v += tmp
        np.sqrt(v, out=den)
        den /= bias_correction2_sqrt
        den += eps
        np.divide(m, den, out=tmp)
        tmp *= step_size
        w -= tmp


def _check_adam_params(params: AdamParams) -> None:
    problems = []
    if not (math.isfinite(params.learning_rate) and params.learning_rate >= 0):
        problems.append(f"learning_rate must be a finite number >= 0, got {params.learning_rate}")
    for name in ("beta1", "beta2"):
        value = getattr(params, name)
        if not 0 <= value < 1:
            problems.append(f"{name} must be in [0, 1), got {value}")
    if not params.eps > 0:
        problems.append(f"eps must be > 0, got {params.eps}")
    if not params.weight_decay >= 0:
        problems.append(f"weight_decay must be >= 0, got {params.weight_decay}")
    if not params.grad_clip_norm >= 0:
        problems.append(f"grad_clip_norm must be >= 0 (0 disables clipping), got {params.grad_clip_norm}")
    if problems:
        raise InvalidRequest("Invalid AdamParams: " + "; ".join(problems) + ".")


def _adapter_seed(adapter_id: str, seed: int | None) -> int:
    """The adapter's RNG seed: LoraSpec.seed, or one derived from the id so runs stay reproducible."""
    if seed is not None:
        return seed
    return int.from_bytes(hashlib.sha256(adapter_id.encode()).digest()[:8], "little")
