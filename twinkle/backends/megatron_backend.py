"""The `megatron` backend: many tenants' LoRA adapters trained on one Megatron-core GPTModel.

The base model is built from its HF config and loaded from its HF weights (`megatron.model`), split over
the pool's tensor-parallel ranks and frozen. Each tenant gets LoRA pairs on the linear layers, applied by
forward hooks (`megatron.lora_hooks`), and its own AdamW state, step counter and random stream, as in the
transformers backend. Per-token logprobs come from Megatron's vocab-parallel cross entropy on the sharded
logits; the Tinker and Twinkle losses are then the same torch code the transformers backend runs.
Adapters are saved in PEFT's format, so checkpoints load in either backend and in the samplers.

Importing this module imports torch but not megatron-core: without the `megatron` extra, the registry
can still name this backend and `check-config` can say what is missing (`megatron_requirements_problem`).
Data-parallel ranks each take a contiguous share of a batch's datums and gather the outputs, so every rank
receives the same calls and returns the same results; pipeline, context and expert parallelism are
refused for now (see `megatron.parallel`).
"""

from __future__ import annotations

import importlib.util
import secrets
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from twinkle.backends import torch_losses
from twinkle.backends.hf.batching import check_model_inputs, collate
from twinkle.backends.hf.lora import lora_config, target_modules
from twinkle.backends.hf.tenant import RngState, Tenant, TenantSlots, new_optimizer
from twinkle.backends.megatron.requirements import INSTALL_HINT, megatron_requirements_problem
from twinkle.errors import InvalidRequest
from twinkle.types import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    ModelInfo,
    SampleOutput,
    SampleRequest,
)

if TYPE_CHECKING:
    from twinkle.backends.base import SamplerBackend
    from twinkle.backends.megatron.lora_hooks import AdapterBank, TensorParallelOps
    from twinkle.backends.megatron.parallel import ParallelState

__all__ = ["MegatronBackend", "megatron_requirements_problem"]

SamplerFactory = Callable[[], "SamplerBackend"]


class MegatronBackend:
    """Implements `twinkle.backends.base.ModelBackend` with megatron-core."""

    def __init__(
        self,
        model_id: str,
        *,
        torch_dtype: str = "auto",
        max_loras: int = 8,
        max_length: int | None = None,
        device_mesh: Any | None = None,
        device: str | None = None,
        trust_remote_code: bool | None = None,
        sampler_factory: SamplerFactory | None = None,
    ) -> None:
        """`device` None means this rank's CUDA GPU (the only supported setup); "cpu" runs single-rank
        tests on megatron-core's CPU-capable layers (see `megatron.cpu_support`)."""
        target = _pick_device(device)
        # Deferred: these import megatron-core, which is only present with the `megatron` extra.
        from twinkle.backends.megatron import model as megatron_model
        from twinkle.backends.megatron import parallel
        from twinkle.backends.megatron.architecture import Architecture
        from twinkle.backends.megatron.lora_hooks import AdapterBank

        directory, hf_config, tokenizer = _read_hf_model(model_id, trust_remote_code)
        self.arch = Architecture.from_hf_config(hf_config)
        sizes = parallel.ParallelSizes.from_mesh(device_mesh)
        problems = self.arch.tensor_parallel_problems(sizes.tp)
        if problems:
            raise InvalidRequest(
                f"{model_id} cannot be split over tp_size={sizes.tp}: " + "; ".join(problems) + ".",
                hint="Choose a tp_size that divides these sizes.",
            )
        self.device = target
        self.parallel: ParallelState = parallel.initialize(sizes, target)
        self._seed_megatron_rng()
        self.dtype = _pick_dtype(torch_dtype, target)
        config = megatron_model.transformer_config(
            self.arch, dtype=self.dtype, tp_size=sizes.tp, device=target
        )
        self.model = megatron_model.build_model(self.arch, config, target)
        if target.type == "cpu":
            from twinkle.backends.megatron import cpu_support

            cpu_support.keep_rotary_on_device(self.model)
            cpu_support.allocate_buffers_on_cpu()
        megatron_model.load_hf_weights(
            self.model,
            megatron_model.SafetensorsWeights(directory),
            self.arch,
            self.parallel.tp_rank,
            sizes.tp,
        )
        self.model.eval()
        self.bank: AdapterBank = AdapterBank(self.model, self.arch, _tensor_parallel_ops(self.parallel))
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        name = _plain_name(model_id)
        self.info = ModelInfo(
            model_name=name,
            vocab_size=self.arch.vocab_size,
            max_context_length=max_length or self.arch.max_position_embeddings,
            tokenizer_id=name,
            arch=(getattr(hf_config, "architectures", None) or [hf_config.model_type])[0],
            eos_token_id=tokenizer.eos_token_id,
        )
        self.model_id = model_id
        self.tenants = TenantSlots(max_loras)
        self._sampler_factory = sampler_factory
        self._sampler: SamplerBackend | None = None

    @property
    def resident_slots(self) -> int:
        return self.tenants.max_loras

    def _seed_megatron_rng(self) -> None:
        if self.device.type == "cpu":
            from twinkle.backends.megatron import cpu_support

            cpu_support.use_dropout_free_rng_tracker()
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)  # Megatron's dropouts are 0; its tracker only needs to exist

    # Adapters

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        if spec.full:
            raise InvalidRequest(
                "full-parameter training is not available on the megatron backend yet",
                hint="Train it on a transformers pool (backend: transformers); see docs/full_finetune.md.",
            )
        from twinkle.backends.megatron.lora_layout import lora_targets, resolve_parts

        name = self.tenants.reserve(adapter_id)
        config = lora_config(spec, base_model_name=self.info.model_name)  # validates rank, alpha, dropout
        parts = resolve_parts(target_modules(spec, "lm_head"))
        seed = spec.seed if spec.seed is not None else _shared_seed(self.device)
        targets = lora_targets(self.arch, parts)
        self.bank.add(
            name, targets, rank=spec.rank, alpha=float(config.lora_alpha), dropout=spec.dropout, seed=seed
        )
        params = self.bank.adapter(name).parameters()
        rng = RngState.seeded(seed, self.device)
        self.tenants.add(Tenant(adapter_id, name, spec, seed, params, new_optimizer(params), rng))

    def remove_adapter(self, adapter_id: str) -> None:
        tenant = self.tenants.pop(adapter_id)
        if tenant is not None:
            self.bank.remove(tenant.name)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.tenants

    # Compute

    def forward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self._run(self.tenants[adapter_id], batch, backward=False)

    def forward_backward(self, adapter_id: str, batch: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self._run(self.tenants[adapter_id], batch, backward=True)

    def _run(self, tenant: Tenant, batch: ForwardBackwardInput, *, backward: bool) -> ForwardBackwardOutput:
        config = torch_losses.validate(batch.loss_fn, batch.data, batch.loss_fn_config)
        check_model_inputs(
            batch.data, vocab_size=self.info.vocab_size, max_length=self.info.max_context_length
        )
        share = self._data_parallel_share(batch.data, pairs=batch.loss_fn == "dpo")
        local = batch.data[share]
        outputs: list[dict[str, Any]] = []
        metrics: dict[str, float] = {}
        if local:
            outputs, metrics = self._run_local(tenant, batch.loss_fn, config, local, backward=backward,
                                               base_only=batch.disable_lora and not backward)
        return self._gather_data_parallel(outputs, metrics, len(local))

    def _run_local(
        self, tenant: Tenant, loss_fn: str, config: dict[str, float], data: list[Datum], *, backward: bool,
        base_only: bool = False,
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        inputs = [torch_losses.datum_inputs(loss_fn, datum) for datum in data]
        padded = collate(data, inputs, pad_token_id=self.pad_token_id, device=self.device)
        self.bank.activate(tenant.name)
        reference = None
        if torch_losses.needs_reference(loss_fn, config):
            self.bank.training = False
            with torch.no_grad(), self.bank.disabled():
                reference = self._logprobs(padded.input_ids, padded.targets)
        self.bank.training = backward  # LoRA dropout is on while training only
        adapter = self.bank.disabled() if base_only else nullcontext()
        with tenant.rng.active(self.device), torch.set_grad_enabled(backward), adapter:
            lp = self._logprobs(padded.input_ids, padded.targets)
            loss_batch = torch_losses.LossBatch(lp, padded.inputs, padded.mask, reference)
            terms = torch_losses.compute_loss(loss_fn, loss_batch, config)
            if backward:
                terms.total.backward()
        outputs = [
            {"logprobs": logprobs, "elementwise_loss": losses}
            for logprobs, losses in zip(padded.unpad(lp), padded.unpad(terms.elementwise), strict=True)
        ]
        return outputs, {"loss:sum": float(terms.total.detach()), **terms.metrics}

    def _logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """float32 logprobs of `targets` ([B, T] or [B, T, K]) by Megatron's vocab-parallel cross entropy."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        length = input_ids.shape[1]
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand_as(input_ids)
        # Right padding: the causal mask alone keeps real positions from seeing padding (True = masked).
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).triu(1)[None, None]
        logits = self.model(
            input_ids=input_ids, position_ids=positions, attention_mask=causal
        )  # [B, T, V/tp]
        columns = [targets] if targets.dim() == 2 else list(targets.unbind(-1))
        # The cross entropy overwrites its logits argument, so each target column gets its own float32 copy.
        logprobs = [
            -vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), column) for column in columns
        ]
        return logprobs[0] if targets.dim() == 2 else torch.stack(logprobs, dim=-1)

    def _data_parallel_share(self, data: list[Datum], *, pairs: bool) -> slice:
        """This data-parallel rank's contiguous share of the datums (whole chosen/rejected pairs for dpo)."""
        size = self.parallel.sizes.dp
        if size == 1:
            return slice(0, len(data))
        from megatron.core import parallel_state

        rank = parallel_state.get_data_parallel_rank()
        unit = 2 if pairs else 1
        units = len(data) // unit
        start, stop = (units * rank) // size, (units * (rank + 1)) // size
        return slice(start * unit, stop * unit)

    def _gather_data_parallel(
        self, outputs: list[dict[str, Any]], metrics: dict[str, float], count: int
    ) -> ForwardBackwardOutput:
        """Every datum's outputs, in batch order, and the metrics over the whole batch, on every rank.

        `:sum` metrics add up; `:mean` metrics are averaged weighted by each rank's datum count.
        """
        if self.parallel.sizes.dp == 1:
            return ForwardBackwardOutput(outputs, metrics)
        shares: list[Any] = [None] * self.parallel.sizes.dp
        dist.all_gather_object(shares, (outputs, metrics, count), group=self.parallel.dp_group)
        gathered = [output for share_outputs, _, _ in shares for output in share_outputs]
        total = sum(share_count for _, _, share_count in shares) or 1
        combined: dict[str, float] = {}
        for name in {key for _, share_metrics, _ in shares for key in share_metrics}:
            values = [(m[name], c) for _, m, c in shares if name in m]
            if name.endswith(":sum"):
                combined[name] = sum(value for value, _ in values)
            else:
                combined[name] = sum(value * share_count for value, share_count in values) / total
        return ForwardBackwardOutput(gathered, combined)

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        from twinkle.backends.megatron.optimizer import adam_step

        tenant = self.tenants[adapter_id]
        splits = self.bank.splits(tenant.name)
        sharded = [splits[key] != "replicated" for key in self._param_keys(tenant)]
        return adam_step(
            tenant, params, sharded=sharded, dp_group=self.parallel.dp_group, tp_group=self.parallel.tp_group
        )

    # Checkpoints

    def save_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        from twinkle.backends.megatron import checkpoint

        tenant = self.tenants[adapter_id]
        self._save_adapter(tenant, directory)
        if include_optimizer:
            checkpoint.save_training_state(tenant, directory, self._param_keys(tenant), self._layout(tenant))

    def load_state(self, adapter_id: str, directory: Path, *, include_optimizer: bool) -> None:
        from twinkle.backends.megatron import checkpoint

        tenant = self.tenants[adapter_id]
        adapter = self.bank.adapter(tenant.name)
        current = lora_config(tenant.spec, base_model_name=self.info.model_name)
        state = checkpoint.read_adapter(directory, adapter.targets, current, self._layout(tenant))
        self.bank.load_local_state(tenant.name, state)
        tenant.zero_grad()
        if include_optimizer:
            checkpoint.load_training_state(
                tenant, directory, self._param_keys(tenant), self._layout(tenant), self.device
            )
        else:
            tenant.optimizer = new_optimizer(tenant.params)
            tenant.steps = 0

    def save_weights_for_sampler(self, adapter_id: str, directory: Path) -> None:
        self._save_adapter(self.tenants[adapter_id], directory)

    def _save_adapter(self, tenant: Tenant, directory: Path) -> None:
        from twinkle.backends.megatron import checkpoint

        adapter = self.bank.adapter(tenant.name)
        config = lora_config(tenant.spec, base_model_name=self.info.model_name)
        checkpoint.save_adapter(
            directory, self.bank.local_state(tenant.name), adapter.targets, config, self._layout(tenant)
        )

    def _param_keys(self, tenant: Tenant) -> list[str]:
        """The Megatron LoRA key of each optimizer parameter, in the optimizer's order."""
        return [key for target in self.bank.adapter(tenant.name).targets for key in target.megatron_keys]

    def _layout(self, tenant: Tenant) -> Any:
        from twinkle.backends.megatron.checkpoint import ShardLayout

        return ShardLayout(
            rank=self.parallel.tp_rank,
            size=self.parallel.sizes.tp,
            group=self.parallel.tp_group,
            splits=self.bank.splits(tenant.name),
            writer=self.parallel.is_first_rank,
        )

    # Sampling

    def sample(self, adapter_id: str | None, requests: list[SampleRequest]) -> list[SampleOutput]:
        """Sample with the adapter's current weights through a sampler over the same base model.

        Megatron-core has no sampling loop for LoRA tenants, so the adapter is written to a temporary PEFT
        directory and served by the sampler (by default a torch sampler, built on first use).
        """
        if adapter_id is None:
            return self._samples().sample([replace(request, adapter_path=None) for request in requests])
        with tempfile.TemporaryDirectory(prefix="twinkle-megatron-sample-") as scratch:
            self.save_weights_for_sampler(adapter_id, Path(scratch))
            return self._samples().sample([replace(request, adapter_path=scratch) for request in requests])

    def _samples(self) -> SamplerBackend:
        if self._sampler is None:
            if self._sampler_factory is not None:
                self._sampler = self._sampler_factory()
            else:
                from twinkle.samplers.torch_sampler import TorchSampler

                dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
                    self.dtype
                ]
                self._sampler = TorchSampler(self.model_id, torch_dtype=dtype, device=str(self.device))
        return self._sampler


def _pick_device(device: str | None) -> torch.device:
    """This rank's GPU; or the CPU when asked for explicitly (tests). Refuses what cannot run."""
    if device is not None and torch.device(device).type == "cpu":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise InvalidRequest("backend: megatron needs megatron-core.", hint=INSTALL_HINT)
        return torch.device("cpu")
    problem = megatron_requirements_problem()
    if problem is not None:
        raise InvalidRequest(problem)
    if device is not None:
        target = torch.device(device)
    else:
        import os

        target = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(target)
    return target


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    from twinkle.backends.hf.loading import pick_dtype

    return pick_dtype(name, device)


def _read_hf_model(model_id: str, trust_remote_code_flag: bool | None) -> tuple[Path, Any, Any]:
    """The checkpoint directory, its HF config and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    from twinkle.backends.hf.loading import model_directory, trust_remote_code

    directory = model_directory(model_id)
    remote = trust_remote_code(trust_remote_code_flag)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=remote)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=remote)
    return directory, config, tokenizer


def _plain_name(model_id: str) -> str:
    for scheme in ("hf://", "ms://"):
        if model_id.startswith(scheme):
            return model_id[len(scheme) :]
    return model_id


def _tensor_parallel_ops(state: ParallelState) -> TensorParallelOps:
    """The LoRA path's collectives over Megatron's tensor-parallel group."""
    from twinkle.backends.megatron.lora_hooks import TensorParallelOps

    if state.sizes.tp == 1:
        return TensorParallelOps()
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    return TensorParallelOps(
        size=state.sizes.tp,
        rank=state.tp_rank,
        copy_to_region=copy_to_tensor_model_parallel_region,
        reduce_from_region=reduce_from_tensor_model_parallel_region,
    )


def _shared_seed(device: torch.device) -> int:
    """A random adapter seed that every rank agrees on (the adapter's A must match across ranks)."""
    seed = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())
