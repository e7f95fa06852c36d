"""A PEFT LoRA adapter uploaded by a tenant, checked before it becomes a checkpoint (`POST /import_adapter`).

The upload is a tar archive (plain, or gzip / bz2 / xz compressed) holding `adapter_config.json` and
`adapter_model.safetensors`, at its root or in one top directory, as `PeftModel.save_pretrained` writes them.
Nothing in it is trusted:

- members: no absolute paths, no `..`, no links or devices; pickled weights (`adapter_model.bin`, `.pt`, ...)
  are refused, other files (a README) are ignored and never stored;
- the config: a LoRA config (`peft_type: LORA`) with rank, alpha and dropout in range, and none of the variants
  Twinkle's LoRA does not compute (DoRA, rsLoRA, bias terms, fan_in_fan_out, per-module ranks,
  modules_to_save, ...);
- the weights: a well-formed safetensors file, parsed here (no library that could unpickle anything), whose
  tensors are all `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` in float32, float16 or bfloat16,
  with finite values; every module is a linear layer of the base model, with `lora_A` [r, in] and `lora_B`
  [out, r] for the base layer's shape and the config's rank r.

The shapes come from the base model's pool, which publishes its linear layers (`lora_modules` in
`twinkle.backends.hf.lora_modules`). What passes is written anew: a normalized `adapter_config.json` whose
target modules are exactly the adapted ones, and a canonical safetensors file; the transformers backend and
the torch sampler load that directory like any checkpoint they wrote. No torch here: the API runs this.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import re
import struct
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

import numpy as np

from twinkle.catalog import Catalog, ServedModel, strip_scheme
from twinkle.errors import InvalidRequest
from twinkle.types import LoraSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Byte sizes, and the exponent bits that are all ones for inf and NaN (checked without converting).
DTYPES: dict[str, tuple[int, Any, int]] = {
    "F32": (4, np.uint32, 0x7F800000), "F16": (2, np.uint16, 0x7C00), "BF16": (2, np.uint16, 0x7F80)}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
MAX_MEMBERS = 1000
MAX_RANK = 1024
MAX_TENSORS = 100_000
CHUNK = 8 << 20
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<part>[AB])\.weight")
_SAVE_HINT = "Save it with PeftModel.save_pretrained(dir) (safetensors is its default) and upload that directory."

# Config options that change what the adapter computes, and which Twinkle's LoRA does not do.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "use_rslora": "rank-stabilized scaling (use_rslora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "lora_bias": "LoRA bias terms (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass
class AdapterUpload:
    """A parsed upload: the config's settings and the weights file's tensors, not yet checked against a base."""

    weights: Path
    tensors: dict[str, Tensor]
    rank: int
    alpha: float
    dropout: float
    target_modules: list[str] | str | None
    declared_base: str | None  # the config's base_model_name_or_path
    ignored: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ModuleShapes:
    """The linear layers of a base model an adapter may sit on: module name -> (out_features, in_features)."""

    modules: dict[str, tuple[int, int]]
    unembed: str = "lm_head"

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ModuleShapes:
        modules = {name: (int(shape[0]), int(shape[1])) for name, shape in value.get("modules", {}).items()}
        return cls(modules, str(value.get("unembed") or "lm_head"))


# -- the archive --------------------------------------------------------------------------------------------


def parse_upload(archive: Path, staging: Path, *, max_bytes: int) -> AdapterUpload:
    """Unpack the two adapter files from `archive` into `staging` and parse them; InvalidRequest names what is
    wrong with the upload."""
    config_raw, weights, ignored = unpack(archive, staging, max_bytes=max_bytes)
    settings = read_config(config_raw)
    tensors = read_safetensors(weights)
    return AdapterUpload(weights=weights, tensors=tensors, ignored=ignored, **settings)


def unpack(archive: Path, staging: Path, *, max_bytes: int) -> tuple[bytes, Path, list[str]]:
    """(config bytes, weights file, ignored member names) from a tar archive, reading it once, in order."""
    staging.mkdir(parents=True, exist_ok=True)
    found: dict[str, str] = {}  # file name -> member name
    ignored: list[str] = []
    config_raw = b""
    weights = staging / WEIGHTS_FILE
    unpacked = 0
    try:
        with tarfile.open(str(archive), mode="r|*") as tar:
            for count, member in enumerate(tar, start=1):
                if count > MAX_MEMBERS:
                    raise InvalidRequest(f"The archive has more than {MAX_MEMBERS} members.",
                                         hint=f"Send only {CONFIG_FILE} and {WEIGHTS_FILE}.")
                parts = member_path(member)
                if member.isdir():
                    continue
                if not member.isfile():
                    raise InvalidRequest(f"Archive member {_shown(member.name)} is a link or a special file.",
                                         hint="Send regular files only (tar without symlinks).")
                unpacked += member.size  # ignored members count too: a compressed archive can hide a lot
                if unpacked > max_bytes:
                    raise InvalidRequest(f"The archive unpacks to more than {max_bytes} bytes.",
                                         hint="Upload the adapter files alone (storage.max_adapter_upload_bytes).")
                shown = "/".join(parts)
                if shown.lower().endswith(PICKLE_SUFFIXES):
                    raise InvalidRequest(f"Archive member {_shown(shown)} is a pickle (PyTorch .bin/.pt file); "
                                         "pickles can run code, so only safetensors weights are accepted.",
                                         hint=_SAVE_HINT)
                if len(parts) > 2 or parts[-1] not in (CONFIG_FILE, WEIGHTS_FILE):
                    ignored.append(shown)
                    continue
                if parts[-1] in found:
                    raise InvalidRequest(f"The archive holds two {parts[-1]} ({_shown(found[parts[-1]])} and "
                                         f"{_shown(shown)}).", hint="Send one adapter per upload.")
                found[parts[-1]] = shown
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                if parts[-1] == CONFIG_FILE:
                    if member.size > MAX_CONFIG_BYTES:
                        raise InvalidRequest(f"{CONFIG_FILE} has {member.size} bytes; a LoRA config has a few "
                                             "hundred.", hint=f"Send the {CONFIG_FILE} PEFT wrote.")
                    config_raw = source.read()
                else:
                    with weights.open("wb") as out:
                        _copy(source, out)
    except InvalidRequest:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise  # the server's disk (a storage failure), not the upload
        raise InvalidRequest(f"The upload is not a readable tar archive ({type(exc).__name__}: "
                             f"{str(exc)[:200] or 'truncated'}).",
                             hint=f"Send a tar (optionally gzip-compressed) of {CONFIG_FILE} and {WEIGHTS_FILE}, "
                             "e.g. tar -C adapter_dir -cf adapter.tar adapter_config.json "
                             "adapter_model.safetensors.") from None
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in found]
    if missing:
        pickled = "" if WEIGHTS_FILE in found else " (adapter_model.bin pickles are not accepted)"
        raise InvalidRequest(f"The archive has no {' and no '.join(missing)}{pickled}.",
                             hint=f"Send the directory PeftModel.save_pretrained wrote: {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE}, at the archive's root or in one top directory.")
    if len({PurePosixPath(path).parent for path in found.values()}) > 1:
        raise InvalidRequest(f"{CONFIG_FILE} and {WEIGHTS_FILE} lie in different directories "
                             f"({_shown(found[CONFIG_FILE])}, {_shown(found[WEIGHTS_FILE])}).",
                             hint="Send one adapter directory.")
    return config_raw, weights, ignored


def member_path(member: tarfile.TarInfo) -> list[str]:
    """The member's path as parts, refusing absolute paths, `..` and names no file system would take."""
    name = member.name
    if "\x00" in name or "\\" in name or any(ord(c) < 32 for c in name):
        raise InvalidRequest(f"Archive member {_shown(name)} has a control character or a backslash in its name.",
                             hint="Use plain file names.")
    if name.startswith("/"):
        raise InvalidRequest(f"Archive member {_shown(name)} has an absolute path.",
                             hint="Archive relative paths (tar -C adapter_dir -cf adapter.tar .).")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(f"Archive member {_shown(name)} leads out of the archive ('..').",
                             hint="Archive relative paths (tar -C adapter_dir -cf adapter.tar .).")
    if member.islnk() or member.issym():
        raise InvalidRequest(f"Archive member {_shown(name)} is a link.",
                             hint="Send regular files only (tar without symlinks).")
    return parts or ["."]


def _copy(source: IO[bytes], out: IO[bytes]) -> None:
    while chunk := source.read(CHUNK):
        out.write(chunk)


def _shown(name: str) -> str:
    return repr(name if len(name) <= 120 else name[:117] + "...")


# -- the config ---------------------------------------------------------------------------------------------


def read_config(raw: bytes) -> dict[str, Any]:
    """rank, alpha, dropout, target_modules and declared_base from adapter_config.json, or InvalidRequest."""
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidRequest(f"{CONFIG_FILE} is not valid JSON.", hint=f"Send the {CONFIG_FILE} PEFT wrote.") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"{CONFIG_FILE} is not a JSON object.", hint=f"Send the {CONFIG_FILE} PEFT wrote.")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidRequest(f"{CONFIG_FILE} describes a {_shown(str(peft_type))} adapter; only LoRA adapters can "
                             "be imported.", hint="Train a LoRA adapter (peft.LoraConfig).")
    problems = []
    rank: Any = config.get("r")
    if not _is_int(rank) or not 1 <= rank <= MAX_RANK:
        problems.append(f"r must be an integer from 1 to {MAX_RANK}, got {_shown(str(rank))}")
    alpha: Any = config.get("lora_alpha", 8)
    if not _is_number(alpha) or not math.isfinite(alpha) or alpha <= 0:
        problems.append(f"lora_alpha must be a positive number, got {_shown(str(alpha))}")
    dropout: Any = config.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout < 1:
        problems.append(f"lora_dropout must be in [0, 1), got {_shown(str(dropout))}")
    targets = config.get("target_modules")
    if not (targets is None or isinstance(targets, str)
            or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        problems.append("target_modules must be a list of module names or a string")
    unsupported = [text for option, text in UNSUPPORTED_OPTIONS.items() if config.get(option)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config.get('bias')!r}")
    if unsupported:
        problems.append("it uses " + ", ".join(unsupported) + ", which Twinkle's LoRA does not compute")
    if problems:
        raise InvalidRequest(f"{CONFIG_FILE} cannot be imported: " + "; ".join(problems) + ".",
                             hint="Import a plain LoRA adapter (peft.LoraConfig with r, lora_alpha, target_modules, "
                             "lora_dropout).")
    declared = config.get("base_model_name_or_path")
    return {"rank": int(rank), "alpha": float(alpha), "dropout": float(dropout), "target_modules": targets,
            "declared_base": declared if isinstance(declared, str) and declared else None}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# -- the weights --------------------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file, its header checked as strictly as the format's own reader does:
    known dtypes, sizes that match the shapes, and data that fills the file exactly, without overlaps."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _not_safetensors("it is shorter than a safetensors header")
        length = struct.unpack("<Q", head)[0]
        if length > MAX_HEADER_BYTES or 8 + length > size:
            if head.startswith(b"PK\x03\x04") or (head[0] == 0x80 and 2 <= head[1] <= 5):  # torch.save: zip, pickle
                raise InvalidRequest(f"{WEIGHTS_FILE} is a PyTorch pickle (torch.save), not safetensors; pickles "
                                     "can run code, so they are not accepted.", hint=_SAVE_HINT)
            raise _not_safetensors(f"its header claims {length} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _not_safetensors("its header is not JSON") from None
    if not isinstance(header, dict):
        raise _not_safetensors("its header is not a JSON object")
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise _not_safetensors(f"it declares {len(header)} tensors")
    data_start, data_size = 8 + length, size - 8 - length
    tensors: dict[str, Tensor] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _not_safetensors(f"tensor {_shown(name)} has no description")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) for n in offsets)):
            raise _not_safetensors(f"tensor {_shown(name)} has a malformed shape or data_offsets")
        if dtype not in DTYPES:
            raise InvalidRequest(f"Tensor {_shown(name)} of {WEIGHTS_FILE} is {_shown(str(dtype))}; adapters are "
                                 f"imported in {', '.join(DTYPES)} only.", hint="Save the adapter in float32, "
                                 "float16 or bfloat16 (not quantized).")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * DTYPES[dtype][0]:
            raise _not_safetensors(f"tensor {_shown(name)} does not fit its data ({_shown(str(offsets))})")
        tensors[name] = Tensor(dtype, tuple(shape), data_start + begin, data_start + end)
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise _not_safetensors("its tensors overlap or leave gaps")
        position = end
    if position != data_size:
        raise _not_safetensors(f"it has {data_size - position} bytes past its last tensor (truncated or padded)")
    return tensors


def _not_safetensors(why: str) -> InvalidRequest:
    return InvalidRequest(f"{WEIGHTS_FILE} is not a valid safetensors file: {why}.",
                          hint=f"Upload the file as PEFT wrote it (a corrupted or truncated copy?). {_SAVE_HINT}")


# -- the base model -----------------------------------------------------------------------------------------


def find_base_model(catalog: Catalog, explicit: str | None, declared: str | None) -> ServedModel:
    """The served model the adapter is for: `explicit` (the upload's base_model) or the config's
    base_model_name_or_path, matched by name, hub id or a path's last component."""
    if explicit:
        return catalog.find(explicit)
    if not declared:
        raise InvalidRequest(f"{CONFIG_FILE} names no base model (base_model_name_or_path).",
                             hint="Pass base_model=<a served model> with the upload.")
    plain = strip_scheme(declared).rstrip("/")
    for candidate in dict.fromkeys((declared, plain, os.path.basename(plain))):
        try:
            return catalog.find(candidate)
        except InvalidRequest:
            continue
    served = ", ".join(sorted(catalog.models)) or "(none)"
    raise InvalidRequest(f"The adapter was trained on {_shown(declared)} (base_model_name_or_path), which this "
                         f"server does not serve. Served models: {served}.",
                         hint="Import adapters of a served base model; if it is the same model under another name, "
                         "pass base_model=<served name>.")


def check_against_base(upload: AdapterUpload, shapes: ModuleShapes, base_name: str) -> LoraSpec:
    """The LoraSpec that rebuilds exactly this adapter on the base model, or InvalidRequest naming the tensor,
    module or shape that does not fit."""
    if not upload.tensors:
        raise InvalidRequest(f"{WEIGHTS_FILE} holds no tensors.", hint="Upload a trained adapter's weights.")
    parts: dict[str, dict[str, Tensor]] = {}
    for name, tensor in sorted(upload.tensors.items()):
        match = _TENSOR.fullmatch(name)
        if match is None:
            raise InvalidRequest(f"Tensor {_shown(name)} is not a LoRA weight. " + _tensor_hint(name),
                                 hint="Import a plain LoRA adapter saved by PEFT (tensors named base_model.model."
                                 "<module>.lora_A.weight and .lora_B.weight).")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    rank = upload.rank
    for module, pair in parts.items():
        if module not in shapes.modules:
            raise InvalidRequest(f"The adapter has LoRA weights for {_shown(module)}, which {base_name} does not "
                                 "have as a linear layer.", hint=f"Import an adapter trained on {base_name}.")
        missing = sorted({"A", "B"} - set(pair))
        if missing:
            raise InvalidRequest(f"{_shown(module)} has no lora_{missing[0]} weight.",
                                 hint="Upload the complete adapter (every module needs lora_A and lora_B).")
        a, b = pair["A"].shape, pair["B"].shape
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise InvalidRequest(f"The LoRA weights of {_shown(module)} (lora_A {list(a)}, lora_B {list(b)}) do not "
                                 f"have the config's rank r={rank}.",
                                 hint=f"Send the {CONFIG_FILE} that was saved with these weights.")
        out_features, in_features = shapes.modules[module]
        if a[1] != in_features or b[0] != out_features:
            raise InvalidRequest(f"The LoRA weights of {_shown(module)} have shapes lora_A {list(a)}, lora_B "
                                 f"{list(b)}; {base_name}'s layer takes {in_features} inputs and gives "
                                 f"{out_features} outputs, so they must be [{rank}, {in_features}] and "
                                 f"[{out_features}, {rank}]: the adapter was made for another base model.",
                                 hint=f"Import an adapter trained on {base_name}.")
    _check_declared_targets(upload.target_modules, set(parts), shapes, base_name)
    flags = _train_flags(set(parts), shapes)
    return LoraSpec(rank=rank, alpha=upload.alpha, dropout=upload.dropout,
                    target_modules=spec_targets(set(parts), shapes), train_mlp=flags["train_mlp"],
                    train_attn=flags["train_attn"], train_unembed=flags["train_unembed"])


def _tensor_hint(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return "It is DoRA's magnitude vector; DoRA adapters cannot be imported."
    if "lora_embedding_" in name:
        return "It belongs to a LoRA on an embedding layer; only LoRA on linear layers can be imported."
    if ".base_layer." in name:
        return ("It is a full copy of a base model weight (PEFT saves embedding layers with an adapter on a tied or "
                "resized output head); save with save_pretrained(dir, save_embedding_layers=False) if the vocabulary "
                "is unchanged.")
    if name.endswith(".bias"):
        return "It is a bias term; adapters with bias='all' or 'lora_only' cannot be imported."
    return "Only lora_A and lora_B weights of linear layers can be imported (no modules_to_save, no prefixes)."


def _check_declared_targets(targets: list[str] | str | None, adapted: set[str], shapes: ModuleShapes,
                            base_name: str) -> None:
    """Every target module the config lists exists in the base model, and covers the adapted modules. A regex
    or `all-linear` is left to the tensors, which say exactly what is adapted (a client's regex is never run)."""
    if not isinstance(targets, list):
        return
    for target in targets:
        if not any(_matches(module, target) for module in shapes.modules):
            raise InvalidRequest(f"Target module {_shown(target)} of {CONFIG_FILE} does not exist in {base_name} (as "
                                 "a linear layer).", hint=f"Import an adapter trained on {base_name}.")
    uncovered = sorted(module for module in adapted if not any(_matches(module, t) for t in targets))
    if uncovered:
        raise InvalidRequest(f"{WEIGHTS_FILE} has LoRA weights for {_shown(uncovered[0])}, which the target_modules "
                             f"of {CONFIG_FILE} do not name.", hint=f"Send the {CONFIG_FILE} that was saved with "
                             "these weights.")


def _matches(module: str, target: str) -> bool:
    """PEFT's rule for a target list: the module's name, or its last dotted parts."""
    return module == target or module.endswith("." + target)


def spec_targets(adapted: set[str], shapes: ModuleShapes) -> tuple[str, ...]:
    """Short names (`q_proj`) when they pick exactly the adapted modules, else every module's full name (an
    adapter on some layers only): either way PEFT rebuilds the same modules."""
    short = sorted({module.rsplit(".", 1)[-1] for module in adapted})
    picked = {module for module in shapes.modules if any(_matches(module, name) for name in short)}
    return tuple(short) if picked == adapted else tuple(sorted(adapted))


def _train_flags(adapted: set[str], shapes: ModuleShapes) -> dict[str, bool]:
    """The Tinker flags weights_info reports, read off the adapted modules."""
    last = {module.rsplit(".", 1)[-1] for module in adapted}
    return {"train_attn": bool(last & set(ATTENTION)), "train_mlp": bool(last & set(MLP)),
            "train_unembed": shapes.unembed in last}


# -- writing the checkpoint ---------------------------------------------------------------------------------


def write_adapter(upload: AdapterUpload, spec: LoraSpec, base_name: str, directory: Path) -> str:
    """A normalized adapter_config.json and a canonical adapter_model.safetensors in `directory`, refusing
    tensors with NaN or infinite values. Returns the weights file's sha256."""
    write_config(spec, base_name, directory / CONFIG_FILE)
    names = sorted(upload.tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for name in names:
        tensor = upload.tensors[name]
        header[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                        "data_offsets": [position, position + tensor.end - tensor.start]}
        position += tensor.end - tensor.start
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    with upload.weights.open("rb") as source, (directory / WEIGHTS_FILE).open("wb") as out:
        for chunk in (struct.pack("<Q", len(encoded)), encoded):
            out.write(chunk)
            digest.update(chunk)
        for name in names:
            for chunk in _tensor_chunks(source, name, upload.tensors[name]):
                out.write(chunk)
                digest.update(chunk)
    return digest.hexdigest()


def write_config(spec: LoraSpec, base_name: str, path: Path) -> None:
    targets = spec.target_modules
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": [targets] if isinstance(targets, str) else list(targets or ()),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_dora": False, "use_rslora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _tensor_chunks(source: IO[bytes], name: str, tensor: Tensor) -> Iterator[bytes]:
    size, bits, exponent = DTYPES[tensor.dtype]
    step = CHUNK - CHUNK % size
    source.seek(tensor.start)
    left = tensor.end - tensor.start
    while left > 0:
        chunk = source.read(min(step, left))
        if not chunk:
            raise _not_safetensors("it ends inside a tensor")
        values = np.frombuffer(chunk, dtype=np.dtype(bits).newbyteorder("<"))
        if np.any((values & exponent) == exponent):
            raise InvalidRequest(f"Tensor {_shown(name)} holds NaN or infinite values.",
                                 hint="Import an adapter whose training did not diverge.")
        left -= len(chunk)
        yield chunk
