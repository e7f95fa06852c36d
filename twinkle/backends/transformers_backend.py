"""The `transformers` backend: many tenants' LoRA adapters trained on one shared HuggingFace model.

The base model is loaded once and frozen. Each tenant gets a named PEFT adapter on the same PeftModel plus
its own AdamW optimizer, step counter and random stream (`hf.tenant`). Gradients accumulate on the tenant's
own parameters, and only the active tenant's parameters require grad, so interleaving tenants' calls
gives the same result as running them one after another.

A vision-language base model also takes images, as ImageChunks or as an InputFeature's vision arrays
(`hf.images`); its tenants' LoRA adapters sit on the language model only.
"""

from __future__ import annotations

import secrets
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig

from twinkle.backends import torch_losses
from twinkle.backends.data_parallel import GradientReducer
from twinkle.backends.hf import checkpoint, fused_batch
from twinkle.backends.hf import paging as host_paging
from twinkle.backends.hf.batching import PaddedBatch, check_model_inputs, collate, target_logprobs
from twinkle.backends.hf.generation import generate
from twinkle.backends.hf.images import images_checked_by_model
from twinkle.backends.hf.loading import load_base_model
from twinkle.backends.hf.lora import lora_config
from twinkle.backends.hf.shared_model import BASE_ADAPTER, SharedModel
from twinkle.backends.hf.tenant import RngState, Tenant, TenantSlots, adam_step, new_optimizer
from twinkle.backends.paging import AdapterPager, PagedAdapter, PagingBudget
from twinkle.errors import InvalidRequest
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

    @property
    def device(self) -> torch.device:
        return self.shared.base.device

    @property
    def compute_dtype(self) -> str:
        """The dtype the base model computes in (`float32`, `bfloat16`, ...)."""
        return str(self.shared.base.model.dtype).removeprefix("torch.")

    # Adapters

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
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
        self.pager.forget(adapter_id)
        tenant = self.tenants.pop(adapter_id)
        if tenant is not None:
            self.shared.delete_adapter(tenant.name)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.pager

    def tenant(self, adapter_id: str) -> Tenant:
        """The adapter's tenant, paged in first when it left its slot."""
        self.pager.use(adapter_id)
        return self.tenants[adapter_id]

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
        return fused_batch.solo_reason(self.shared, fused_batch.FusedCall(self.tenant(adapter_id), batch, False))

    def run_fused(self, calls: list[tuple[str, ForwardBackwardInput, bool]]) -> list[ForwardBackwardOutput | Exception]:
        """Several adapters' (adapter_id, batch, backward) calls as one pass; each gets its own output or error,
        as if it had run alone."""
        results: list[ForwardBackwardOutput | Exception] = []
        for part in host_paging.slot_sized(calls, self.pager.slots):  # a pass's adapters all sit in slots
            self.pager.use_all([adapter_id for adapter_id, _, _ in part])
            fused = [fused_batch.FusedCall(self.tenants[adapter_id], batch, backward)
                     for adapter_id, batch, backward in part]
            results.extend(fused_batch.run(self.shared, fused, vocab_size=self.info.vocab_size,
                                           max_length=self.info.max_context_length, device=self.device))
        return results

    def _run(self, tenant: Tenant, batch: ForwardBackwardInput, *, backward: bool) -> ForwardBackwardOutput:
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
        self.shared.activate(tenant.name)
        reference = self._reference_logprobs(padded) if torch_losses.needs_reference(batch.loss_fn, config) else None
        self.shared.train(backward)  # LoRA dropout is on while training only
        base_only = self.shared.adapters_disabled() if batch.disable_lora and not backward else nullcontext()
        with tenant.rng.active(self.device), torch.set_grad_enabled(backward), base_only:
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

    def _reference_logprobs(self, padded: PaddedBatch) -> torch.Tensor:
        """The base model's logprobs for the same batch: the tenant's adapter switched off, no second copy."""
        self.shared.train(False)
        with torch.no_grad(), self.shared.adapters_disabled():
            return self._logprobs(padded)

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        return adam_step(self.tenant(adapter_id), params)

    def sync_gradients(self, adapter_id: str, reducer: GradientReducer) -> None:
        """Sum the adapter's accumulated gradients over the data-parallel ranks (backends.data_parallel), in
        one all-reduce. A parameter keeps grad None where no rank has one, as AdamW skips those."""
        params = self.tenant(adapter_id).params
        ranks_with_grad = np.array([param.grad is not None for param in params], np.float32)
        grads = [param.grad if param.grad is not None else torch.zeros_like(param) for param in params]
        reducer.sum_([ranks_with_grad, *grads])
        for param, grad, count in zip(params, grads, ranks_with_grad, strict=True):
            param.grad = grad if count > 0 else None

    # Checkpoints

    def save_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        tenant = self.tenant(adapter_id)
        checkpoint.save_adapter(self.shared, tenant.name, directory)
        if include_optimizer:
            checkpoint.save_training_state(tenant, directory)

    def load_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        tenant = self.tenant(adapter_id)
        checkpoint.load_adapter(self.shared, tenant, directory)
        tenant.zero_grad()
        if include_optimizer:
            checkpoint.load_training_state(tenant, directory, self.device)
        else:
            tenant.optimizer = new_optimizer(tenant.params)
            tenant.steps = 0

    def save_weights_for_sampler(self, adapter_id: str, directory: Path) -> None:
        checkpoint.save_adapter(self.shared, self.tenant(adapter_id).name, directory)

    # Sampling

    def sample(self, adapter_id: str | None, requests: list[SampleRequest]) -> list[SampleOutput]:
        name = BASE_ADAPTER if adapter_id is None else self.tenant(adapter_id).name
        return generate(self.shared, requests, [name] * len(requests))
