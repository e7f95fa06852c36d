"""The model behind the numpy mock backend and sampler: a class-factored bigram language model with LoRA.

The next token depends on the previous token only. The vocabulary is split into `C` classes of `S`
consecutive ids (S = ceil(sqrt(V)), the last class padded), and the model factors

    p(next | prev) = p(class(next) | prev) · p(next | class(next), prev)

(Goodman 2001), so the log-probability of one target costs O(C + S) instead of O(V): a training step on a
152k vocabulary never materialises a [tokens, V] matrix. Both factors are softmaxes over logits

    logits(prev) = b + h·Wᵀ + scale · (h·A)·Bᵀ        h = E[prev]

whose columns are the C class logits followed by the C·S token logits (a token's logits are read within
its class). E [V, d], W [C + C·S, d] and b are the frozen base model, drawn from a fixed seed so every
process builds the same one. A [d, r] and B [C + C·S, r] are one tenant's LoRA adapter: A is random, B
starts at zero (a fresh adapter is exactly the base model), and scale = alpha / r. Matrices are stored
output-major so that a class's block of rows is contiguous.

A full-parameter run trains E, W and b themselves (`accumulate_base_gradients`) on its own copy of the base,
and saves them with `save_base`: a model directory holding that file (`BASE_FILE`) is served with those
weights instead of the seeded ones (`served_base`), so a full checkpoint is itself a mock model directory.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twinkle.errors import InvalidRequest, NotFound
from twinkle.types import ModelInfo

EMBEDDING_DIM = 32
DEFAULT_CONTEXT_LENGTH = 32768
ADAPTER_FILE = "adapter.npz"
ADAPTER_FORMAT = "twinkle-mock-lora/1"
BASE_FILE = "mock_bigram.npz"
BASE_FORMAT = "twinkle-mock-bigram/1"
_BASE_SEED = 20240917
_MASKED_LOGIT = np.float32(-1e30)  # padding ids: exp() underflows to exactly 0, and no inf arithmetic


@dataclass(frozen=True)
class BigramBase:
    """The frozen base model shared by every adapter."""

    vocab_size: int
    class_size: int  # S
    num_classes: int  # C
    embeddings: np.ndarray  # E [V, d] float32
    unembedding: np.ndarray  # W [C + C·S, d] float32
    bias: np.ndarray  # b [C + C·S] float32, padding ids masked

    @classmethod
    def build(cls, vocab_size: int, dim: int = EMBEDDING_DIM) -> BigramBase:
        if vocab_size < 2:
            raise ValueError(f"The mock model needs a vocabulary of at least 2 tokens, got {vocab_size}.")
        class_size, num_classes = _class_layout(vocab_size)
        rng = np.random.default_rng([_BASE_SEED, vocab_size, dim])
        embeddings = rng.standard_normal((vocab_size, dim), dtype=np.float32)
        unembedding = rng.standard_normal((num_classes * (class_size + 1), dim), dtype=np.float32)
        unembedding *= np.float32(1 / math.sqrt(dim))
        bias = np.zeros(num_classes * (class_size + 1), np.float32)
        bias[num_classes + vocab_size :] = _MASKED_LOGIT
        return cls(vocab_size, class_size, num_classes, embeddings, unembedding, bias)

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    @property
    def columns(self) -> int:
        return int(self.bias.shape[0])

    def block(self, token_class: int) -> slice:
        """The rows of W, b and B holding the token logits of one class."""
        start = self.num_classes + token_class * self.class_size
        return slice(start, start + self.class_size)

    def parameters(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """E, W and b: what a full-parameter run trains."""
        return self.embeddings, self.unembedding, self.bias

    def copy(self) -> BigramBase:
        return BigramBase(self.vocab_size, self.class_size, self.num_classes,
                          *(array.copy() for array in self.parameters()))

    def mask_padding(self) -> None:
        """Pin the padding ids' logits to the mask again. Their gradient is exactly zero, but weight decay
        would still scale the mask, and a decay factor below zero would turn it into the largest logit."""
        self.bias[self.num_classes + self.vocab_size :] = _MASKED_LOGIT


@dataclass
class LoraWeights:
    """One adapter: the trainable low-rank update of the base logits."""

    down: np.ndarray  # A [d, r] float32
    up: np.ndarray  # B [C + C·S, r] float32
    scale: float

    @classmethod
    def fresh(cls, base: BigramBase, rank: int, alpha: float, rng: np.random.Generator) -> LoraWeights:
        down = rng.standard_normal((base.dim, rank), dtype=np.float32) * np.float32(1 / math.sqrt(base.dim))
        return cls(down, np.zeros((base.columns, rank), np.float32), alpha / rank)

    @property
    def rank(self) -> int:
        return int(self.down.shape[1])

    def copy(self) -> LoraWeights:
        return LoraWeights(self.down.copy(), self.up.copy(), self.scale)


@dataclass
class LoraGrads:
    """Accumulated gradients of an adapter, shaped like its weights."""

    down: np.ndarray
    up: np.ndarray

    @classmethod
    def zeros_like(cls, lora: LoraWeights) -> LoraGrads:
        return cls(np.zeros_like(lora.down), np.zeros_like(lora.up))


@dataclass
class BaseGrads:
    """Accumulated gradients (or AdamW moments) of a full-parameter run, shaped like the base's E, W, b."""

    embeddings: np.ndarray
    unembedding: np.ndarray
    bias: np.ndarray

    @classmethod
    def zeros_like(cls, base: BigramBase) -> BaseGrads:
        return cls(*(np.zeros_like(array) for array in base.parameters()))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.embeddings, self.unembedding, self.bias


def class_rows(base: BigramBase, classes: np.ndarray) -> list[slice]:
    """Rows of B holding the class logits plus the token blocks of `classes` (a bool mask [C]), as
    contiguous runs. The optimizer touches only these: every other row of B is zero in the weights,
    gradients and moments alike, and stays zero under AdamW."""
    padded = np.zeros(len(classes) + 2, np.int8)  # np.r_ would do, at several times the cost of the diff itself
    padded[1:-1] = classes
    edges = np.flatnonzero(np.diff(padded)).reshape(-1, 2)
    runs = [slice(base.block(int(start)).start, base.block(int(stop) - 1).stop) for start, stop in edges]
    if runs and runs[0].start == base.num_classes:
        return [slice(0, runs[0].stop), *runs[1:]]
    return [slice(0, base.num_classes), *runs]


def nonzero_classes(base: BigramBase, *arrays: np.ndarray) -> np.ndarray:
    """The classes whose token block is non-zero in any of `arrays` (each shaped like B)."""
    classes = np.zeros(base.num_classes, bool)
    for array in arrays:
        blocks = array[base.num_classes :].reshape(base.num_classes, -1)
        classes |= blocks.any(axis=1)
    return classes


@dataclass
class TargetPass:
    """Target logprobs of a batch of (prev, target) pairs, and what the backward pass reuses."""

    logprobs: np.ndarray  # [N] float32
    features: np.ndarray  # h after dropout: the input of A, or of W in a full run [N, d]
    low_rank: np.ndarray  # scale · h·A [N, r]
    target_class: np.ndarray  # [N]
    class_probs: np.ndarray  # [N, C]
    order: np.ndarray  # rows sorted by target class
    group_starts: np.ndarray  # into `order`, one per distinct class, plus N
    token_probs: np.ndarray  # within-class probabilities, rows in `order` [N, S]
    within_class: np.ndarray  # position of each target inside its class, rows in `order` [N]
    prev: np.ndarray  # [N]
    dropout_mask: np.ndarray | None  # scaled by 1/(1-p) [N, d]

    def classes(self, num_classes: int) -> np.ndarray:
        """The classes of this pass's targets, as a bool mask [C]."""
        mask = np.zeros(num_classes, bool)
        mask[self.target_class] = True
        return mask


def target_logprobs(
    base: BigramBase,
    lora: LoraWeights | None,
    prev: np.ndarray,
    target: np.ndarray,
    dropout_mask: np.ndarray | None = None,
) -> TargetPass:
    """log p(target | prev) per row. `dropout_mask` (already scaled by 1/(1-p)) applies to the input of the
    trained weights: A's with a LoRA, W's without one (a full-parameter run)."""
    embedded = base.embeddings[prev]
    features = embedded if dropout_mask is None else embedded * dropout_mask
    low_rank = _low_rank(features, lora)
    hidden = embedded if lora is not None else features
    target_class = target // base.class_size
    class_lp, class_probs = _softmax(_logits(base, lora, hidden, low_rank, slice(0, base.num_classes)))

    order = np.argsort(target_class, kind="stable")
    sorted_class = target_class[order]
    # where the class changes, plus both ends (class ids are >= 0, so -1 differs from every neighbour)
    group_starts = np.flatnonzero(np.diff(sorted_class, prepend=-1, append=-1)) if len(order) else np.zeros(1, np.intp)
    sorted_hidden, sorted_low = hidden[order], (None if low_rank is None else low_rank[order])
    token_logits = np.empty((len(order), base.class_size), hidden.dtype)
    for start, stop in itertools.pairwise(group_starts):
        rows = slice(start, stop)
        block = base.block(int(sorted_class[start]))
        token_logits[rows] = _logits(base, lora, sorted_hidden[rows], _rows(sorted_low, rows), block)
    token_lp, token_probs = _softmax(token_logits)
    within = target[order] - sorted_class * base.class_size

    logprobs = np.take_along_axis(class_lp, target_class[:, None], axis=1)[:, 0]
    logprobs[order] += token_lp[np.arange(len(order)), within]
    return TargetPass(
        logprobs=logprobs,
        features=features,
        low_rank=np.zeros((len(prev), 0), hidden.dtype) if low_rank is None else low_rank,
        target_class=target_class,
        class_probs=class_probs,
        order=order,
        group_starts=group_starts,
        token_probs=token_probs,
        within_class=within,
        prev=prev,
        dropout_mask=dropout_mask,
    )


def accumulate_gradients(
    base: BigramBase, lora: LoraWeights, forward: TargetPass, dloss_dlp: np.ndarray, grads: LoraGrads
) -> None:
    """Add d(loss)/d(A, B) into `grads`, given d(loss)/d(logprob) per row of `forward`."""
    class_dlogits, token_dlogits = _dlogits(forward, dloss_dlp.astype(grads.up.dtype, copy=False))
    classes = slice(0, base.num_classes)
    grads.up[classes] += class_dlogits.T @ forward.low_rank
    dlow = class_dlogits @ lora.up[classes]
    sorted_low = forward.low_rank[forward.order]
    sorted_dlow = np.empty_like(sorted_low)
    starts = forward.group_starts
    for start, stop in itertools.pairwise(starts):
        block = base.block(int(forward.target_class[forward.order[start]]))
        grads.up[block] += token_dlogits[start:stop].T @ sorted_low[start:stop]
        sorted_dlow[start:stop] = token_dlogits[start:stop] @ lora.up[block]
    dlow[forward.order] += sorted_dlow
    dlow *= np.float32(lora.scale)
    grads.down += forward.features.T @ dlow


def accumulate_base_gradients(
    base: BigramBase, forward: TargetPass, dloss_dlp: np.ndarray, grads: BaseGrads
) -> None:
    """Add d(loss)/d(E, W, b) into `grads`, given d(loss)/d(logprob) per row of `forward`, a pass of `base`
    without LoRA (`target_logprobs(base, None, ...)`)."""
    class_dlogits, token_dlogits = _dlogits(forward, dloss_dlp.astype(grads.bias.dtype, copy=False))
    features = forward.features
    classes = slice(0, base.num_classes)
    grads.unembedding[classes] += class_dlogits.T @ features
    grads.bias[classes] += class_dlogits.sum(axis=0)
    dfeatures = class_dlogits @ base.unembedding[classes]
    sorted_features = features[forward.order]
    sorted_dfeatures = np.empty_like(sorted_features)
    for start, stop in itertools.pairwise(forward.group_starts):
        block = base.block(int(forward.target_class[forward.order[start]]))
        rows = slice(start, stop)
        grads.unembedding[block] += token_dlogits[rows].T @ sorted_features[rows]
        grads.bias[block] += token_dlogits[rows].sum(axis=0)
        sorted_dfeatures[rows] = token_dlogits[rows] @ base.unembedding[block]
    dfeatures[forward.order] += sorted_dfeatures
    if forward.dropout_mask is not None:
        dfeatures *= forward.dropout_mask
    # Rows sharing a previous token add into one row of E: sum them first, then scatter once.
    tokens, inverse = np.unique(forward.prev, return_inverse=True)
    per_token = np.zeros((len(tokens), features.shape[1]), dfeatures.dtype)
    np.add.at(per_token, inverse, dfeatures)
    grads.embeddings[tokens] += per_token


def _dlogits(forward: TargetPass, dlp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d(loss)/d(class logits) [N, C] and d(loss)/d(within-class logits) [N, S], rows in `forward.order`."""
    rows = np.arange(len(dlp))
    # d lp / d logits of a log-softmax is onehot(target) - softmax.
    class_dlogits = forward.class_probs * -dlp[:, None]
    class_dlogits[rows, forward.target_class] += dlp
    sorted_dlp = dlp[forward.order]
    token_dlogits = forward.token_probs * -sorted_dlp[:, None]
    token_dlogits[rows, forward.within_class] += sorted_dlp
    return class_dlogits, token_dlogits


def next_token_logprobs(base: BigramBase, lora: LoraWeights | None, prev: np.ndarray) -> np.ndarray:
    """The full next-token distribution, log p(· | prev) [N, V] float32."""
    hidden = base.embeddings[prev]
    logits = _logits(base, lora, hidden, _low_rank(hidden, lora), slice(None))
    class_lp, _ = _softmax(logits[:, : base.num_classes])
    token_lp, _ = _softmax(
        logits[:, base.num_classes :].reshape(len(prev), base.num_classes, base.class_size)
    )
    joint: np.ndarray = class_lp[:, :, None] + token_lp
    return joint.reshape(len(prev), -1)[:, : base.vocab_size]


def save_adapter(directory: Path, base: BigramBase, lora: LoraWeights, extra: dict[str, np.ndarray]) -> None:
    """Write the adapter (and `extra` arrays, e.g. optimizer state) as one `.npz` into `directory`."""
    arrays = {
        "format": np.array(ADAPTER_FORMAT),
        "vocab_size": np.array(base.vocab_size),
        "scale": np.array(lora.scale),
        "down": lora.down,
        "up": lora.up,
        **extra,
    }
    with open(directory / ADAPTER_FILE, "wb") as handle:
        np.savez(handle, allow_pickle=False, **arrays)


def load_adapter(directory: Path, base: BigramBase) -> tuple[LoraWeights, dict[str, np.ndarray]]:
    """Read what `save_adapter` wrote: the weights and every other array in the file."""
    path = Path(directory) / ADAPTER_FILE
    if not path.is_file():
        raise NotFound(
            f"No mock adapter weights in checkpoint directory {Path(directory).name!r}.",
            hint="Check the checkpoint path; it must come from save_state or save_weights_for_sampler.",
        )
    with np.load(path, allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    if str(arrays.get("format")) != ADAPTER_FORMAT:
        raise InvalidRequest(f"Checkpoint {Path(directory).name!r} is not a mock-backend adapter.")
    if int(arrays["vocab_size"]) != base.vocab_size:
        raise InvalidRequest(
            f"Checkpoint {Path(directory).name!r} was trained on a vocabulary of {int(arrays['vocab_size'])} "
            f"tokens, but this model has {base.vocab_size}.",
            hint="Load it into a model with the same base model.",
        )
    lora = LoraWeights(arrays.pop("down"), arrays.pop("up"), float(arrays.pop("scale")))
    return lora, arrays


def save_base(directory: Path, base: BigramBase) -> None:
    """Write the base model's weights (`BASE_FILE`) into `directory`: a model directory with this file and a
    config.json is served with these weights (`served_base`)."""
    arrays = {
        "format": np.array(BASE_FORMAT),
        "vocab_size": np.array(base.vocab_size),
        "embeddings": base.embeddings,
        "unembedding": base.unembedding,
        "bias": base.bias,
    }
    with open(Path(directory) / BASE_FILE, "wb") as handle:
        np.savez(handle, allow_pickle=False, **arrays)


def load_base(directory: Path, vocab_size: int) -> BigramBase:
    """Read what `save_base` wrote, for a model whose vocabulary has `vocab_size` tokens."""
    name = Path(directory).name
    path = Path(directory) / BASE_FILE
    if not path.is_file():
        raise NotFound(
            f"No mock model weights in directory {name!r}.",
            hint="Check the path; a full-parameter checkpoint holds them after save_state or save_weights_for_sampler.",
        )
    with np.load(path, allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    if str(arrays.get("format")) != BASE_FORMAT:
        raise InvalidRequest(f"{name!r} does not hold mock-model weights.")
    stored_vocab = int(arrays["vocab_size"])
    if stored_vocab != vocab_size:
        raise InvalidRequest(
            f"{name!r} holds a model with a vocabulary of {stored_vocab} tokens, but this model has {vocab_size}.",
            hint="Use it with a model of the same vocabulary.",
        )
    class_size, num_classes = _class_layout(vocab_size)
    embeddings, unembedding, bias = arrays["embeddings"], arrays["unembedding"], arrays["bias"]
    columns = num_classes * (class_size + 1)
    dim = embeddings.shape[1] if embeddings.ndim == 2 else -1
    shapes = (embeddings.shape, unembedding.shape, bias.shape)
    if shapes != ((vocab_size, dim), (columns, dim), (columns,)) or any(
        array.dtype != np.float32 for array in (embeddings, unembedding, bias)
    ):
        raise InvalidRequest(f"{name!r} holds mock-model weights of the wrong shapes or types.")
    return BigramBase(vocab_size, class_size, num_classes, embeddings, unembedding, bias)


def served_base(source: ModelSource) -> BigramBase:
    """The base model a backend or sampler serves: the weights in the model directory (`BASE_FILE`, written
    by a full-parameter run), otherwise the seeded ones every process builds alike."""
    if source.directory is not None and (source.directory / BASE_FILE).is_file():
        return load_base(source.directory, source.info.vocab_size)
    return BigramBase.build(source.info.vocab_size)


@dataclass(frozen=True)
class ModelSource:
    """Where the mock model's description came from: a model directory or a bare vocabulary size."""

    info: ModelInfo
    directory: Path | None


def read_model_source(
    model_dir_or_vocab: str | int | os.PathLike[str], max_length: int | None
) -> ModelSource:
    """Describe the mock model from an HF-style model dir (its config.json) or from a vocabulary size."""
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}.")
    context = max_length or DEFAULT_CONTEXT_LENGTH
    if isinstance(model_dir_or_vocab, int) or str(model_dir_or_vocab).isdigit():
        vocab = int(str(model_dir_or_vocab))
        return ModelSource(ModelInfo("mock", vocab, context, None, "mock-bigram"), None)
    directory = Path(model_dir_or_vocab).absolute()
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"The mock backend needs a vocabulary size or a model directory with config.json: "
            f"{directory} has none."
        )
    config = json.loads(config_path.read_text())
    text_config = config.get("text_config") or {}
    vocab_size: object = config.get("vocab_size") or text_config.get("vocab_size")
    if not isinstance(vocab_size, int):
        raise TypeError(f"{config_path} has no integer vocab_size.")
    eos = config.get("eos_token_id", text_config.get("eos_token_id"))
    eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
    info = ModelInfo(
        model_name=directory.name,
        vocab_size=vocab_size,
        max_context_length=context,
        tokenizer_id=str(directory),
        arch="mock-bigram",
        eos_token_id=eos_token_id if isinstance(eos_token_id, int) else None,
    )
    return ModelSource(info, directory)


def _class_layout(vocab_size: int) -> tuple[int, int]:
    """(S, C): classes of ceil(sqrt(V)) ids, enough of them to hold the vocabulary."""
    class_size = math.isqrt(vocab_size - 1) + 1
    return class_size, -(-vocab_size // class_size)


def _low_rank(features: np.ndarray, lora: LoraWeights | None) -> np.ndarray | None:
    if lora is None:
        return None
    low_rank: np.ndarray = features @ lora.down
    low_rank *= np.float32(lora.scale)
    return low_rank


def _logits(
    base: BigramBase,
    lora: LoraWeights | None,
    hidden: np.ndarray,
    low_rank: np.ndarray | None,
    columns: slice,
) -> np.ndarray:
    logits: np.ndarray = hidden @ base.unembedding[columns].T
    logits += base.bias[columns]
    if lora is not None and low_rank is not None:
        logits += low_rank @ lora.up[columns].T
    return logits


def _rows(array: np.ndarray | None, rows: slice) -> np.ndarray | None:
    return None if array is None else array[rows]


def _softmax(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-softmax, softmax) over the last axis, sharing one exp."""
    shifted: np.ndarray = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted)
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total
    shifted -= np.log(total)
    return shifted, probs
