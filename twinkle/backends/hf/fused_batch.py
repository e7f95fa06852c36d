"""Many tenants' forward / forward_backward calls as one pass through the shared base model.

Each call keeps its own validation, padding, loss function and metrics; only the model forward is shared:
all calls' rows are right-padded to the longest and run once with per-row LoRA routing (`fused_lora`).
Row r's logits depend only on row r's tokens and its adapter, so each call's logprobs are the ones it
would get alone, and since tenants share no trainable parameter, one backward of the summed losses
gives every adapter exactly the gradient of its own loss. Calls whose adapters are not trained in that
pass keep `requires_grad` off, so their `.grad` stays untouched (None stays None, which AdamW relies on).

Calls that need what a fused pass cannot give exactly run alone instead (`solo_reason`): LoRA dropout
(each tenant's random stream draws masks shaped like its own batch), images, `disable_lora`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from twinkle.backends import torch_losses
from twinkle.backends.hf.batching import PaddedBatch, check_model_inputs, collate, target_logprobs
from twinkle.backends.hf.fused_lora import BASE_ROW, routed, unsupported
from twinkle.backends.hf.shared_model import SharedModel
from twinkle.backends.hf.tenant import Tenant
from twinkle.types import ForwardBackwardInput, ForwardBackwardOutput


@dataclass
class FusedCall:
    tenant: Tenant
    batch: ForwardBackwardInput
    backward: bool


@dataclass
class _Prepared:
    call: FusedCall
    padded: PaddedBatch
    config: dict[str, float]
    rows: slice = field(default_factory=lambda: slice(0))


Outcome = ForwardBackwardOutput | Exception


def solo_reason(shared: SharedModel, call: FusedCall) -> str | None:
    """Why this call must run on its own (None: it can share a fused pass)."""
    if call.tenant.spec.dropout > 0:
        return "LoRA dropout draws from the tenant's own random stream"
    if call.batch.disable_lora:
        return "disable_lora reads the bare base model"
    if any(datum.images() for datum in call.batch.data):
        return "images are expanded per call"
    if shared.peft is None:
        return "no adapters"
    return unsupported(shared.peft, [call.tenant.name])


def run(shared: SharedModel, calls: Sequence[FusedCall], *, vocab_size: int, max_length: int,
        device: torch.device) -> list[Outcome]:
    """Every call's output, or the error that call alone raised (a bad batch fails only its own call)."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    prepared: dict[int, _Prepared] = {}
    for index, call in enumerate(calls):
        try:
            prepared[index] = _prepare(shared, call, vocab_size=vocab_size, max_length=max_length, device=device)
        except Exception as error:  # noqa: BLE001 - reported to that call's future
            outcomes[index] = error
    # Trained calls and inference calls run as two passes: training mode and autograd differ between them.
    for backward in (True, False):
        group = {index: item for index, item in prepared.items() if item.call.backward is backward}
        if group:
            try:
                results: list[Outcome] = _pass(shared, list(group.values()), backward=backward)
            except Exception as error:  # noqa: BLE001 - the shared pass failed: every call in it reports that
                results = [error] * len(group)
            for index, result in zip(group, results, strict=True):
                outcomes[index] = result
    return [outcome if outcome is not None else RuntimeError("not run") for outcome in outcomes]


def _prepare(shared: SharedModel, call: FusedCall, *, vocab_size: int, max_length: int,
             device: torch.device) -> _Prepared:
    data = list(call.batch.data)
    config = torch_losses.validate(call.batch.loss_fn, data, call.batch.loss_fn_config)
    check_model_inputs(data, vocab_size=vocab_size, max_length=max_length)
    inputs = [torch_losses.datum_inputs(call.batch.loss_fn, datum) for datum in data]
    padded = collate(data, inputs, pad_token_id=shared.base.pad_token_id, device=device)
    return _Prepared(call, padded, config)


def _pass(shared: SharedModel, items: list[_Prepared], *, backward: bool) -> list[Outcome]:
    assert shared.peft is not None
    input_ids, attention, names = _joined(shared, items)
    references = _references(shared, items, input_ids, attention)
    shared.train(backward)
    outcomes: list[Outcome] = []
    totals = []
    trained = [item.call.tenant for item in items] if backward else []
    with _trainable(shared, trained), torch.set_grad_enabled(backward), routed(shared.peft, names):
        logits = shared(adapter_names=None, input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        for item, reference in zip(items, references, strict=True):
            try:
                padded = item.padded
                width = padded.input_ids.shape[1]
                lp = target_logprobs(logits[item.rows, :width], padded.targets)
                loss_batch = torch_losses.LossBatch(lp, padded.inputs, padded.mask, reference)
                terms = torch_losses.compute_loss(item.call.batch.loss_fn, loss_batch, item.config)
            except Exception as error:  # noqa: BLE001 - this call's loss alone failed
                outcomes.append(error)
                continue
            totals.append(terms.total)
            outcomes.append(ForwardBackwardOutput(
                [{"logprobs": logprobs, "elementwise_loss": losses}
                 for logprobs, losses in zip(padded.unpad(lp), padded.unpad(terms.elementwise), strict=True)],
                {"loss:sum": float(terms.total.detach()), **terms.metrics},
            ))
        if backward and totals:
            torch.stack(totals).sum().backward()
    return outcomes


def _joined(shared: SharedModel, items: list[_Prepared]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """All items' rows right-padded to the longest, and each row's adapter name."""
    width = max(item.padded.input_ids.shape[1] for item in items)
    ids, masks, names = [], [], []
    start = 0
    for item in items:
        padded = item.padded
        extra = width - padded.input_ids.shape[1]
        ids.append(torch.nn.functional.pad(padded.input_ids, (0, extra), value=shared.base.pad_token_id))
        masks.append(torch.nn.functional.pad(padded.attention_mask, (0, extra), value=0))
        rows = padded.input_ids.shape[0]
        item.rows = slice(start, start + rows)
        names.extend([item.call.tenant.name] * rows)
        start += rows
    return torch.cat(ids), torch.cat(masks), names


def _references(shared: SharedModel, items: list[_Prepared], input_ids: torch.Tensor,
                attention: torch.Tensor) -> list[torch.Tensor | None]:
    """The base model's logprobs for the items whose loss reads a reference policy (one no-grad pass)."""
    wanted = [torch_losses.needs_reference(item.call.batch.loss_fn, item.config) for item in items]
    if not any(wanted):
        return [None] * len(items)
    assert shared.peft is not None
    shared.train(False)
    with torch.no_grad(), routed(shared.peft, [BASE_ROW] * input_ids.shape[0]):
        logits = shared(adapter_names=None, input_ids=input_ids, attention_mask=attention, use_cache=False).logits
    return [target_logprobs(logits[item.rows, :item.padded.input_ids.shape[1]], item.padded.targets) if want
            else None for item, want in zip(items, wanted, strict=True)]


@contextmanager
def _trainable(shared: SharedModel, tenants: Sequence[Tenant]) -> Iterator[None]:
    """Exactly these tenants' parameters require grad inside the block; every flag is restored after."""
    assert shared.peft is not None
    trained = {id(param) for tenant in tenants for param in tenant.params}
    saved: list[tuple[torch.nn.Parameter, bool]] = []
    for name, param in shared.peft.named_parameters():
        if "lora_" not in name:
            continue
        want = id(param) in trained
        if param.requires_grad != want:
            saved.append((param, param.requires_grad))
            param.requires_grad_(want)
    try:
        yield
    finally:
        for param, flag in saved:
            param.requires_grad_(flag)

