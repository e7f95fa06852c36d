"""Find a base model (local directory, `hf://`, `ms://`), load it once, and describe it as a ModelInfo.

A vision-language model (its config has a `vision_config`) loads as AutoModelForImageTextToText with its
AutoProcessor, so images can reach it (`hf.images`); without a usable image processor it still trains and
samples on text. Every other model loads as AutoModelForCausalLM with its tokenizer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from twinkle.backends.hf.images import ImageInputs, vision_processor
from twinkle.errors import InvalidRequest
from twinkle.types import ModelInfo

TRUST_REMOTE_CODE_ENV = "TWINKLE_TRUST_REMOTE_CODE"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class BaseModel:
    """The loaded base model with what every op needs to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    info: ModelInfo
    eos_token_ids: frozenset[int]
    pad_token_id: int
    images: ImageInputs  # refuses images on a text-only model


def pick_device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on accelerators (the memory halves, the matmuls speed up) and fp32 on CPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise InvalidRequest(f"Unknown torch_dtype {name!r}.", hint=f"Use auto, {', '.join(DTYPES)}.")
    return DTYPES[name]


def trust_remote_code(explicit: bool | None) -> bool:
    """Remote code runs only when the operator opts in, by argument or TWINKLE_TRUST_REMOTE_CODE=1."""
    if explicit is not None:
        return explicit
    return os.environ.get(TRUST_REMOTE_CODE_ENV, "0").strip().lower() in ("1", "true", "yes")


def model_directory(model_id: str) -> Path:
    """A local directory holding the model: the path itself, or a hub snapshot of `hf://`/`ms://` ids.

    A plain `org/name` that is not a local directory means the HuggingFace hub.
    """
    local = Path(model_id).expanduser()
    if local.is_dir():
        return local
    if model_id.startswith("ms://"):
        return _modelscope_snapshot(model_id[len("ms://") :])
    repo_id = model_id[len("hf://") :] if model_id.startswith("hf://") else model_id
    if repo_id.count("/") != 1:
        raise InvalidRequest(
            f"Model {model_id!r} is neither a local directory nor a hub id.",
            hint="Use a directory, hf://org/name, ms://org/name or org/name.",
        )
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id))


def _modelscope_snapshot(repo_id: str) -> Path:
    try:
        from modelscope import snapshot_download  # type: ignore[import-not-found, unused-ignore]
    except ImportError as error:
        raise InvalidRequest(
            f"Loading ms://{repo_id} needs the modelscope package.", hint="pip install modelscope"
        ) from error
    return Path(snapshot_download(repo_id))


def load_base_model(
    model_id: str,
    *,
    torch_dtype: str = "auto",
    device: str | None = None,
    trust_remote_code_flag: bool | None = None,
    max_length: int | None = None,
) -> BaseModel:
    """Load tokenizer (or processor) and model with frozen weights, on one device, in inference-friendly state."""
    target_device = pick_device(device)
    dtype = pick_dtype(torch_dtype, target_device)
    directory = model_directory(model_id)
    remote = trust_remote_code(trust_remote_code_flag)
    placement: dict[str, Any] = {"dtype": dtype, "device_map": {"": str(target_device)}, "trust_remote_code": remote}
    config = AutoConfig.from_pretrained(directory, trust_remote_code=remote)
    model = _image_text_model(directory, placement) if getattr(config, "vision_config", None) else None
    processor = vision_processor(directory, trust_remote_code=remote) if model is not None else None
    if processor is not None:
        tokenizer = processor.tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=remote)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(directory, **placement)
    model.requires_grad_(False)
    model.eval()
    eos_ids = _eos_token_ids(model, tokenizer)
    context = max_length or _context_length(model.config.get_text_config())
    info = ModelInfo(
        model_name=_plain_name(model_id),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_context_length=context,
        tokenizer_id=_plain_name(model_id),
        arch=(getattr(model.config, "architectures", None) or [model.config.model_type])[0],
        eos_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(eos_ids, default=None),
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (info.eos_token_id or 0)
    images = ImageInputs(info.model_name, processor, model.forward, vision_model=has_vision_tower(model))
    return BaseModel(model, tokenizer, target_device, info, frozenset(eos_ids), int(pad), images)


def has_vision_tower(model: PreTrainedModel) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def _image_text_model(directory: Path, placement: dict[str, Any]) -> PreTrainedModel | None:
    try:
        model: PreTrainedModel = AutoModelForImageTextToText.from_pretrained(directory, **placement)
    except ValueError:  # an architecture transformers maps to a causal LM only: it is served as text-only
        return None
    return model


def _plain_name(model_id: str) -> str:
    for scheme in ("hf://", "ms://"):
        if model_id.startswith(scheme):
            return model_id[len(scheme) :]
    return model_id


def _context_length(config: PretrainedConfig) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4096


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS ids from tokenizer and generation config: chat models often end turns with a second one."""
    ids: set[int] = set()
    sources = [tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(value) for value in source)
    return ids
