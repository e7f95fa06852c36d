"""The `transformers` backend: many tenants' LoRA adapters trained on one shared HuggingFace model.

The base model is loaded once and frozen. Each tenant gets a named PEFT adapter on the same PeftModel plus
its own AdamW optimizer, step counter and random stream (`hf.tenant`). Gradients accumulate on the tenant's
own parameters, and only the active tenant's parameters require grad, so interleaving tenants' calls
gives the same result as running them one after another.

A vision-language base model also takes images, as ImageChunks or as an InputFeature's vision arrays
(`hf.images`); its tenants' LoRA adapters sit on the language model only.

A model created with `mode="full"` is a full-parameter run instead (`hf.full_run`): the same methods, keyed by its
id, train every base weight with the LoRA adapters switched off, and its checkpoints are HuggingFace model
directories. It is exclusive: one per replica, and LoRA ops are refused (PoolReserved) until it is removed, which
restores the base weights bit for bit. It is never paged out and never joins a fused pass.
"""

from __future__ import annotations

import secrets
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig

from twinkle.backends import torch_losses
from twinkle.backends.data_parallel import GradientReducer
from twinkle.backends.hf import checkpoint, fused_batch
from twinkle.backends.hf import paging as host_paging
from twinkle.backends.hf.batching import PaddedBatch, check_model_inputs, collate, target_logprobs
from twinkle.backends.hf.full_run import DEFAULT_MAX_SHARD_SIZE, FULL_RUN_NAME, FullRun, save_model_directory
from twinkle.backends.hf.generation import generate
from twinkle.backends.hf.images import images_checked_by_model
from twinkle.backends.hf.loading import load_base_model
from twinkle.backends.hf.lora import lora_config
from twinkle.backends.hf.shared_model import BASE_ADAPTER, SharedModel
from twinkle.backends.hf.tenant import RngState, Tenant, TenantSlots, adam_step, new_optimizer
from twinkle.backends.paging import AdapterPager, PagedAdapter, PagingBudget
from twinkle.errors import InvalidRequest, PoolReserved
from twinkle.types import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    ModelInfo,
    SampleOutput,
    SampleRequest,
)


class TransformersBackend:
    """Implements `twinkle.backends.base.ModelBackend` with transformers + PEFT."""

    def __init__(
        self,
        model_id: str,
        *,
        torch_dtype: str = "auto",
        max_loras: int = 8,
        max_length: int | None = None,
        device: str | None = None,
        trust_remote_code: bool | None = None,
        paging: PagingBudget | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    ) -> None:
        base = load_base_model(
            model_id,
            torch_dtype=torch_dtype,
            device=device,
            trust_remote_code_flag=trust_remote_code,
            max_length=max_length,
        )
        self.shared = SharedModel(base)
        self.info: ModelInfo = base.info
        self.tenants = TenantSlots(max_loras)  # the resident tenants; the pager keeps the others
        self.pager = AdapterPager(self, max_loras, paging or PagingBudget())
        self.spares = host_paging.SpareSlots()  # PEFT adapters of paged-out tenants, reused by page-ins
        self.full: FullRun | None = None  # the full-parameter run that holds this replica, if any
        self.max_shard_size = max_shard_size  # of a full run's safetensors files

    @property
    def device(self) -> torch.device:
        return self.shared.base.device

    @property
    def resident_slots(self) -> int:
        return self.tenants.max_loras

    @property
    def compute_dtype(self) -> str:
        """The dtype the base model computes in (`float32`, `bfloat16`, ...)."""
        return str(self.shared.base.model.dtype).removeprefix("torch.")

    # Adapters

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        if spec.full:
            self._start_full_run(adapter_id, spec)
            return
        self._refuse_while_full_run()
        if adapter_id in self.pager:  # resident or paged out
            raise InvalidRequest(f"Adapter {adapter_id} already exists on this replica.")
        self.pager.admit(adapter_id)
        self._drop_spare_for_new_adapter()  # a new adapter's initial weights come from PEFT, seeded
        name = self.tenants.reserve(adapter_id)
        config = self._lora_config(spec)
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        try:
            self.shared.add_adapter(name, config, seed=seed)
        except ValueError as error:  # PEFT: target modules not found in this architecture
            self.shared.delete_adapter(name)
            raise InvalidRequest(f"Cannot build this LoRA adapter on {self.info.model_name}: {error}") from error
        params = self.shared.parameters(name)
        rng = RngState.seeded(seed, self.device)
        self.tenants.add(Tenant(adapter_id, name, spec, seed, params, new_optimizer(params), rng))
        self.pager.added(adapter_id)

    def remove_adapter(self, adapter_id: str) -> None:
        if self._full_run(adapter_id) is not None:
            self._end_full_run()
            return
        self.pager.forget(adapter_id)
        tenant = self.tenants.pop(adapter_id)
        if tenant is not None:
            self.shared.delete_adapter(tenant.name)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.pager or self._full_run(adapter_id) is not None

    def tenant(self, adapter_id: str) -> Tenant:
        """The adapter's tenant, paged in first when it left its slot; a full run's optimizer, step counter and
        random stream live in a Tenant too."""
        full = self._full_run(adapter_id)
        if full is not None:
            return full.tenant
        self._refuse_while_full_run()
        self.pager.use(adapter_id)
        return self.tenants[adapter_id]

    # Full-parameter runs (hf.full_run)

    def _full_run(self, adapter_id: str | None) -> FullRun | None:
        """The full run when `adapter_id` names it."""
        return self.full if self.full is not None and adapter_id == self.full.run_id else None

    def _start_full_run(self, run_id: str, spec: LoraSpec) -> None:
        if self.full is not None:
            raise PoolReserved(
                f"Full-parameter run {self.full.run_id} already holds this replica; it takes one at a time.",
                hint="Wait until that run is unloaded, or train this one as a LoRA adapter.",
                holder=self.full.run_id,
            )
        if run_id in self.pager:
            raise InvalidRequest(f"Adapter {run_id} already exists on this replica.")
        self.full = FullRun.start(run_id, spec, self.shared.base.model, self.device)

    def _end_full_run(self) -> None:
        assert self.full is not None
        self.full.end()
        self.full = None

    def _refuse_while_full_run(self) -> None:
        if self.full is not None:
            raise PoolReserved(
                f"Full-parameter run {self.full.run_id} holds this replica: its LoRA adapters wait until it ends.",
                hint="Retry once the full-parameter run is unloaded.",
                holder=self.full.run_id,
            )

    # Paging (backends.paging)

    def page_out(self, adapter_id: str) -> PagedAdapter:
        """Copy the tenant to host memory; its PEFT adapter stays as a spare slot (`hf.paging`)."""
        tenant = self.tenants[adapter_id]
        paged = host_paging.host_copy(tenant)
        self.tenants.pop(adapter_id)
        self.spares.keep(tenant)
        return paged

    def page_in(self, adapter_id: str, paged: PagedAdapter) -> None:
        spec = paged.state.spec
        spare = self.spares.take(spec)
        if spare is None:  # no spare of this shape: a fresh PEFT adapter, its initial weights overwritten below
            self._drop_spare_for_new_adapter()
            name = self.tenants.reserve(adapter_id)
            self.shared.add_adapter(name, self._lora_config(spec), seed=paged.state.seed)
            spare = name, self.shared.parameters(name)
        self.tenants.add(host_paging.restore(adapter_id, *spare, paged, self.device))

    def _lora_config(self, spec: LoraSpec) -> LoraConfig:
        """The PEFT config of a LoRA adapter `spec` on this model (never on its vision tower)."""
        return lora_config(
            spec,
            base_model_name=self.info.model_name,
            unembed_module=self.shared.unembed_module,
            exclude_modules=self.shared.vision_modules,
        )

    def _drop_spare_for_new_adapter(self) -> None:
        """Delete a spare's PEFT adapter when a new one would exceed max_loras on the device."""
        if len(self.pager.resident_ids()) + len(self.spares) >= self.pager.slots:
            spare = self.spares.pop_any()
            if spare is not None:
                self.shared.delete_adapter(spare)

    def resident_adapters(self) -> list[str]:
        return self.pager.resident_ids()

    def paging_stats(self) -> dict[str, float]:
        return self.pager.stats.as_dict()

    # Compute

    def forward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self._run(self.tenant(adapter_id), batch, backward=False)

    def forward_backward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self._run(self.tenant(adapter_id), batch, backward=True)

    def fused_solo_reason(self, adapter_id: str, batch: ForwardBackwardInput) -> str | None:
        """Why this call cannot join a fused multi-tenant pass (None: it can); see `hf.fused_batch`."""
        if self._full_run(adapter_id) is not None:
            return "a full-parameter run trains the whole model on its own"
        return fused_batch.solo_reason(self.shared, fused_batch.FusedCall(self.tenant(adapter_id), batch, False))

    def run_fused(self, calls: list[tuple[str, ForwardBackwardInput, bool]]) -> list[ForwardBackwardOutput | Exception]:
        """Several adapters' (adapter_id, batch, backward) calls as one pass; each gets its own output or error,
        as if it had run alone."""
        self._refuse_while_full_run()
        results: list[ForwardBackwardOutput | Exception] = []
        for part in host_paging.slot_sized(calls, self.pager.slots):  # a pass's adapters all sit in slots
            self.pager.use_all([adapter_id for adapter_id, _, _ in part])
            fused = [fused_batch.FusedCall(self.tenants[adapter_id], batch, backward)
                     for adapter_id, batch, backward in part]
            results.extend(fused_batch.run(self.shared, fused, vocab_size=self.info.vocab_size,
                                           max_length=self.info.max_context_length, device=self.device))
        return results

    def _run(self, tenant: Tenant, batch: ForwardBackwardInput, *, backward: bool) -> ForwardBackwardOutput:
        full = self._full_run(tenant.adapter_id) if tenant.name == FULL_RUN_NAME else None
        # Images first: an image's token count, which the loss inputs must match, is known only once expanded.
        images = self.shared.base.images
        prepared = [images.datum(datum, f"datum {index}") for index, datum in enumerate(batch.data)]
        data = [datum for datum, _ in prepared]
        config = torch_losses.validate(batch.loss_fn, data, batch.loss_fn_config)
        check_model_inputs(data, vocab_size=self.info.vocab_size, max_length=self.info.max_context_length)
        inputs = [torch_losses.datum_inputs(batch.loss_fn, datum) for datum in data]
        padded = collate(data, inputs, pad_token_id=self.shared.base.pad_token_id, device=self.device)
        padded.vision = images.batch(
            [vision for _, vision in prepared], device=self.device, dtype=self.shared.base.model.dtype
        )
        if full is None:
            self.shared.activate(tenant.name)
        reference = (self._reference_logprobs(padded, full)
                     if torch_losses.needs_reference(batch.loss_fn, config) else None)
        self.shared.train(backward)  # LoRA dropout is on while training only
        with ExitStack() as scope:
            scope.enter_context(tenant.rng.active(self.device))
            scope.enter_context(torch.set_grad_enabled(backward))
            scope.enter_context(self._model_as_seen_by(full, base_only=batch.disable_lora and not backward))
            lp = self._logprobs(padded)
            loss_batch = torch_losses.LossBatch(lp, padded.inputs, padded.mask, reference)
            terms = torch_losses.compute_loss(batch.loss_fn, loss_batch, config)
            if backward:
                terms.total.backward()
        outputs = [
            {"logprobs": logprobs, "elementwise_loss": losses}
            for logprobs, losses in zip(padded.unpad(lp), padded.unpad(terms.elementwise), strict=True)
        ]
        return ForwardBackwardOutput(outputs, {"loss:sum": float(terms.total.detach()), **terms.metrics})

    def _model_as_seen_by(self, full: FullRun | None, *, base_only: bool) -> AbstractContextManager[object]:
        """The model a pass runs: the active tenant's adapter on the base model, or for a full run the trained
        base weights with every adapter off; `base_only`: the base model as loaded, without either."""
        if full is None:
            return self.shared.adapters_disabled() if base_only else nullcontext()
        scope = ExitStack()
        scope.enter_context(self.shared.adapters_disabled())
        if base_only:
            scope.enter_context(full.original_weights())
        return scope

    def _logprobs(self, padded: PaddedBatch) -> torch.Tensor:
        with images_checked_by_model(bool(padded.vision)):
            output = self.shared(
                adapter_names=None,
                input_ids=padded.input_ids,
                attention_mask=padded.attention_mask,
                use_cache=False,
                **padded.vision,
            )
        return target_logprobs(output.logits, padded.targets)

    def _reference_logprobs(self, padded: PaddedBatch, full: FullRun | None) -> torch.Tensor:
        """The base model's logprobs for the same batch: the tenant's adapter switched off, no second copy; for
        a full run, the original weights swapped in from its host copy."""
        self.shared.train(False)
        with torch.no_grad(), self._model_as_seen_by(full, base_only=True):
            return self._logprobs(padded)

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        return adam_step(self.tenant(adapter_id), params)

    def sync_gradients(self, adapter_id: str, reducer: GradientReducer) -> None:
        """Sum the adapter's (or full run's) accumulated gradients over the data-parallel ranks
        (backends.data_parallel), in one all-reduce per GRADIENT_BUCKET_BYTES of gradients: a LoRA adapter's fit
        in one, while a full run's would otherwise need room for a float32 copy of the whole model at once.
        A parameter keeps grad None where no rank has one, as AdamW skips those."""
        params = self.tenant(adapter_id).params
        ranks_with_grad = np.array([param.grad is not None for param in params], np.float32)
        grads = [param.grad if param.grad is not None else torch.zeros_like(param) for param in params]
        for number, bucket in enumerate(_buckets(grads, GRADIENT_BUCKET_BYTES)):
            reducer.sum_([ranks_with_grad, *bucket] if number == 0 else bucket)  # the flags travel with the first
        for param, grad, count in zip(params, grads, ranks_with_grad, strict=True):
            param.grad = grad if count > 0 else None

    # Checkpoints

    def save_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        tenant = self.tenant(adapter_id)
        full = self._full_run(adapter_id)
        if full is not None:
            self._save_full(full, directory, include_optimizer=include_optimizer)
            return
        checkpoint.save_adapter(self.shared, tenant.name, directory)
        if include_optimizer:
            checkpoint.save_training_state(tenant, directory)

    def load_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        tenant = self.tenant(adapter_id)
        full = self._full_run(adapter_id)
        if full is not None:
            full.load_weights(self.shared.base.model, directory)
        else:
            checkpoint.load_adapter(self.shared, tenant, directory)  # refuses a full-parameter checkpoint
            tenant.zero_grad()
        if include_optimizer:
            checkpoint.load_training_state(tenant, directory, self.device)
        else:
            tenant.optimizer = new_optimizer(tenant.params)
            tenant.steps = 0

    def save_weights_for_sampler(self, adapter_id: str, directory: Path) -> None:
        full = self._full_run(adapter_id)
        if full is not None:
            self._save_full(full, directory, include_optimizer=False)
            return
        checkpoint.save_adapter(self.shared, self.tenant(adapter_id).name, directory)

    def _save_full(self, full: FullRun, directory: Path, *, include_optimizer: bool) -> None:
        save_model_directory(full, self.shared.base.model, self.shared.base.tokenizer, directory,
                             base_model=self.info.model_name, include_optimizer=include_optimizer,
                             max_shard_size=self.max_shard_size)

    # Sampling

    def sample(self, adapter_id: str | None, requests: list[SampleRequest]) -> list[SampleOutput]:
        """With a full run on the replica, the base model (None) is served from the run's copy of the original
        weights, and the run samples with its trained weights."""
        if adapter_id is None or self._full_run(adapter_id) is not None:
            original = self.full.original_weights() if adapter_id is None and self.full is not None else nullcontext()
            with original:
                return generate(self.shared, requests, [BASE_ADAPTER] * len(requests))
        return generate(self.shared, requests, [self.tenant(adapter_id).name] * len(requests))


GRADIENT_BUCKET_BYTES = 256 * 1024 * 1024


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of `tensors` of at most `limit` bytes each (a larger tensor alone); at least one group."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    return groups
