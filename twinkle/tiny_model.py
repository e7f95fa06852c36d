"""Tiny random Qwen-family models built on the spot, for tests and demos that cannot reach a model hub.

A build writes an ordinary HuggingFace model directory: a Qwen3 causal LM with seeded random float32 weights
(safetensors), and a byte-level BPE tokenizer trained on the corpus shipped in twinkle/assets, with ChatML
special tokens and chat template. `vision=True` writes a LLaVA model instead (the same Qwen3 text model
behind a one-layer SigLIP vision tower) plus an image processor, loadable with AutoProcessor and
AutoModelForImageTextToText. LLaVA rather than Qwen2-VL because every Qwen-VL processor requires a video
processor, and those need torchvision; LLaVA's processor needs only Pillow.

The same arguments always give byte-identical files, so tests can compare builds and cache them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
)

from twinkle.errors import InvalidRequest

CORPUS_PATH = Path(__file__).parent / "assets" / "tiny_corpus.txt"
BUILD_RECORD_NAME = "twinkle_tiny_model.json"
# Bump when a change to this module changes what a build writes, so cached directories are rebuilt.
BUILDER_VERSION = 1

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD)
BYTE_ALPHABET_SIZE = 256

# Qwen2/Qwen3's own pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, spaces.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML. Content is a string, or a list of {"type": "text"|"image"} parts as in multi-modal
# chats; each image becomes the placeholder the LLaVA processor expands into one token per image patch.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# The vision tower is fixed and minimal: 56x56 images in 14x14 patches give 16 image tokens.
VISION_IMAGE_SIZE = 56
VISION_PATCH_SIZE = 14
VISION_HIDDEN_SIZE = 32
VISION_IMAGE_TOKENS = (VISION_IMAGE_SIZE // VISION_PATCH_SIZE) ** 2


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that decides what a build writes; two equal specs give byte-identical directories."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    seed: int = 0
    vision: bool = False

    def __post_init__(self) -> None:
        smallest_vocab = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
        if self.vocab_size < smallest_vocab:
            raise InvalidRequest(
                f"vocab_size={self.vocab_size} is too small.",
                hint=f"Use at least {smallest_vocab}: 256 byte tokens plus the special tokens.",
            )
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise InvalidRequest(
                f"hidden_size={self.hidden_size} does not split into {self.num_heads} heads of even size.",
                hint="Rotary embeddings need hidden_size to be num_heads times an even head size.",
            )
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequest(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}.",
                hint="Grouped-query attention shares each key/value head among a whole number of heads.",
            )
        if self.max_position_embeddings < 16:
            raise InvalidRequest(f"max_position_embeddings={self.max_position_embeddings} is below 16.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    vision: bool = False,
) -> Path:
    """Write a tiny random model directory at `out_dir` and return its path.

    The directory is assembled next to `out_dir` and renamed into place, so readers never see half a model.
    `out_dir` may be missing, empty, or an earlier tiny-model build (which is replaced); anything else is
    refused rather than deleted. For concurrent callers use ensure_tiny_model, which also serialises builds.
    """
    spec = TinyModelSpec(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        vision=vision,
    )
    target = Path(out_dir).absolute()
    _refuse_foreign_directory(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; workers running as other users must read the model
    try:
        _write_model(staging, spec)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_tiny_model(out_dir: str | Path, **build_args: Any) -> Path:
    """Return `out_dir` holding a tiny model built with `build_args`, building it only when needed.

    A directory is reused when its build record matches these arguments, this builder version and the
    shipped corpus. A lock file beside the directory makes concurrent callers (pytest-xdist workers,
    several Celery workers) build once and wait for each other.
    """
    spec = TinyModelSpec(**build_args)
    target = Path(out_dir).absolute()
    if _holds_build_of(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if _holds_build_of(target, spec):
            return target
        return build_tiny_model(target, **asdict(spec))


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A Qwen-style byte-level BPE tokenizer with ChatML special tokens, trained on the shipped corpus.

    The special tokens take ids 0-5 in SPECIAL_TOKENS order. A corpus too small for `vocab_size` merges
    yields fewer tokens, never more, so len(tokenizer) <= vocab_size always holds.
    """
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer breaks count ties by token ids, not hash order, so threads and hash seeds do not change
    # the merges; tests/twinkle/test_tiny_model.py checks this across processes.
    backend.train_from_iterator(_corpus_text().split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
    )


def _write_model(directory: Path, spec: TinyModelSpec) -> None:
    tokenizer = train_tokenizer(spec.vocab_size)
    tokenizer.model_max_length = spec.max_position_embeddings
    text_config = _text_config(spec, tokenizer)
    model: PreTrainedModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        if spec.vision:
            model = LlavaForConditionalGeneration(_vision_language_config(text_config, tokenizer))
        else:
            model = Qwen3ForCausalLM(text_config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory)
    if spec.vision:
        _image_text_processor(tokenizer).save_pretrained(directory)
    else:
        tokenizer.save_pretrained(directory)
    # Written last: its presence marks the directory complete.
    (directory / BUILD_RECORD_NAME).write_text(json.dumps(_build_record(spec), indent=2, sort_keys=True) + "\n")


def _text_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _vision_language_config(text_config: Qwen3Config, tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    vision_config = SiglipVisionConfig(
        hidden_size=VISION_HIDDEN_SIZE,
        intermediate_size=2 * VISION_HIDDEN_SIZE,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=VISION_IMAGE_SIZE,
        patch_size=VISION_PATCH_SIZE,
        vision_use_head=False,
    )
    return LlavaConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=tokenizer.get_vocab()[IMAGE_PAD],
        image_seq_length=VISION_IMAGE_TOKENS,
        # SigLIP has no CLS token to drop, and with one layer the last hidden state is the only real one.
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        dtype="float32",
    )


def _image_text_processor(tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    try:
        from transformers import SiglipImageProcessorPil
    except ImportError as missing:
        raise InvalidRequest(
            "Building a tiny vision model needs Pillow.", hint="pip install pillow, or pass vision=False."
        ) from missing
    image_processor = SiglipImageProcessorPil(size={"height": VISION_IMAGE_SIZE, "width": VISION_IMAGE_SIZE})
    return LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=VISION_PATCH_SIZE,
        vision_feature_select_strategy="full",
        image_token=IMAGE_PAD,
        num_additional_image_tokens=0,
        chat_template=CHAT_TEMPLATE,
    )


def _build_record(spec: TinyModelSpec) -> dict[str, Any]:
    return {
        "builder_version": BUILDER_VERSION,
        "corpus_sha256": hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest(),
        "args": asdict(spec),
    }


def _read_build_record(directory: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((directory / BUILD_RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _holds_build_of(directory: Path, spec: TinyModelSpec) -> bool:
    return _read_build_record(directory) == _build_record(spec)


def _refuse_foreign_directory(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise InvalidRequest(f"{target} exists and is not a directory.", hint="Pass a directory path.")
    if target.is_dir() and any(target.iterdir()) and _read_build_record(target) is None:
        raise InvalidRequest(
            f"{target} is not empty and holds no tiny model, so it will not be replaced.",
            hint="Pass a new or empty directory.",
        )


def _move_into_place(staging: Path, target: Path) -> None:
    # A directory cannot be renamed over a non-empty one, so the old build steps aside first.
    if target.exists():
        retired = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
        target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        staging.rename(target)


def _corpus_text() -> str:
    return CORPUS_PATH.read_text(encoding="utf-8")
