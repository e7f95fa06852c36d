"""Checking an uploaded PEFT adapter without torch: the archive, the config, the safetensors file and the shapes
against the base model's published linear layers; every refusal names what is wrong."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from twinkle import adapter_import
from twinkle.adapter_import import AdapterUpload, ModuleShapes
from twinkle.catalog import Catalog
from twinkle.config import parse_config
from twinkle.errors import InvalidRequest

HIDDEN, KV, FFN, VOCAB = 64, 32, 128, 512
SHAPES = ModuleShapes({
    **{f"model.layers.{i}.self_attn.{m}": (out, HIDDEN) for i in range(2)
       for m, out in (("q_proj", HIDDEN), ("k_proj", KV), ("v_proj", KV), ("o_proj", HIDDEN))},
    **{f"model.layers.{i}.mlp.{m}": shape for i in range(2)
       for m, shape in (("gate_proj", (FFN, HIDDEN)), ("up_proj", (FFN, HIDDEN)), ("down_proj", (HIDDEN, FFN)))},
    "lm_head": (VOCAB, HIDDEN)}, "lm_head")
PEFT_CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
               "target_modules": ["q_proj", "v_proj"], "bias": "none", "use_dora": False, "use_rslora": False,
               "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False,
               "base_model_name_or_path": "/home/someone/models/tiny-qwen"}


def lora_tensors(modules: dict[str, tuple[int, int]], rank: int = 4, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tensors = {}
    for module, (out, inp) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((rank, inp)).astype(dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((out, rank)).astype(dtype)
    return tensors


ATTENTION = {name: shape for name, shape in SHAPES.modules.items() if name.endswith(("q_proj", "v_proj"))}


def weights_bytes(tensors: dict[str, np.ndarray], tmp_path: Path) -> bytes:
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def archive(files: dict[str, bytes], *, links: dict[str, str] | None = None, compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    raw = buffer.getvalue()
    return gzip.compress(raw) if compress else raw


def adapter_files(tmp_path: Path, config: dict[str, Any] | None = None,
                  tensors: dict[str, np.ndarray] | None = None) -> dict[str, bytes]:
    return {"adapter_config.json": json.dumps(PEFT_CONFIG if config is None else config).encode(),
            "adapter_model.safetensors": weights_bytes(lora_tensors(ATTENTION) if tensors is None else tensors,
                                                       tmp_path)}


def parse(tmp_path: Path, data: bytes, max_bytes: int = 1 << 30) -> AdapterUpload:
    (tmp_path / "upload.tar").write_bytes(data)
    return adapter_import.parse_upload(tmp_path / "upload.tar", tmp_path / "staging", max_bytes=max_bytes)


def refusal(tmp_path: Path, data: bytes, **kw: Any) -> str:
    with pytest.raises(InvalidRequest) as error:
        adapter_import.check_against_base(parse(tmp_path, data, **kw), SHAPES, "tiny-qwen")
    return str(error.value)


def test_a_peft_adapter_becomes_the_lora_spec_that_rebuilds_it(tmp_path: Path) -> None:
    upload = parse(tmp_path, archive({**adapter_files(tmp_path), "README.md": b"# my adapter"}))
    assert upload.declared_base == "/home/someone/models/tiny-qwen" and upload.ignored == ["README.md"]
    spec = adapter_import.check_against_base(upload, SHAPES, "tiny-qwen")
    assert (spec.rank, spec.alpha, spec.dropout) == (4, 8.0, 0.0)
    assert spec.target_modules == ("q_proj", "v_proj")
    assert (spec.train_attn, spec.train_mlp, spec.train_unembed) == (True, False, False)


def test_a_gzipped_archive_with_the_files_in_one_top_directory_is_accepted(tmp_path: Path) -> None:
    files = {f"./my-adapter/{name}": data for name, data in adapter_files(tmp_path).items()}
    upload = parse(tmp_path, archive(files, compress=True))
    assert len(upload.tensors) == 8


def test_an_adapter_on_some_layers_only_is_rebuilt_by_full_module_names(tmp_path: Path) -> None:
    tensors = lora_tensors({"model.layers.1.mlp.down_proj": (HIDDEN, FFN), "lm_head": (VOCAB, HIDDEN)}, rank=2)
    config = {**PEFT_CONFIG, "r": 2, "target_modules": ["down_proj", "lm_head"]}
    spec = adapter_import.check_against_base(parse(tmp_path, archive(adapter_files(tmp_path, config, tensors))),
                                             SHAPES, "tiny-qwen")
    assert spec.target_modules == ("lm_head", "model.layers.1.mlp.down_proj")
    assert (spec.train_attn, spec.train_mlp, spec.train_unembed) == (False, True, True)


def test_the_written_checkpoint_is_canonical_and_holds_the_same_values(tmp_path: Path) -> None:
    upload = parse(tmp_path, archive(adapter_files(tmp_path, tensors=lora_tensors(ATTENTION, dtype=np.float16))))
    spec = adapter_import.check_against_base(upload, SHAPES, "tiny-qwen")
    out = tmp_path / "checkpoint"
    out.mkdir()
    adapter_import.write_adapter(upload, spec, "tiny-qwen", out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-qwen" and config["target_modules"] == ["q_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"], config["use_dora"]) == (4, 8.0, False)
    from safetensors.numpy import load_file

    written = load_file(str(out / "adapter_model.safetensors"))
    for name, value in lora_tensors(ATTENTION, dtype=np.float16).items():
        np.testing.assert_array_equal(written[name], value)


@pytest.mark.parametrize(("name", "message"), [
    ("../adapter_config.json", "leads out of the archive"),
    ("/etc/adapter_config.json", "absolute path"),
    ("a\\..\\b", "backslash"),
    ("dir/adapter_model.bin", "is a pickle"),
    ("optimizer.pt", "is a pickle"),
])
def test_members_that_could_escape_or_unpickle_are_refused_by_name(tmp_path: Path, name: str, message: str) -> None:
    text = refusal(tmp_path, archive({**adapter_files(tmp_path), name: b"x"}))
    assert message in text and repr(name) in text


def test_links_in_the_archive_are_refused(tmp_path: Path) -> None:
    text = refusal(tmp_path, archive(adapter_files(tmp_path), links={"adapter_model.safetensors": "/etc/passwd"}))
    assert "is a link" in text


def test_an_archive_with_only_pickled_weights_is_refused(tmp_path: Path) -> None:
    files = {"adapter_config.json": json.dumps(PEFT_CONFIG).encode()}
    text = refusal(tmp_path, archive(files))
    assert "no adapter_model.safetensors" in text and "pickles are not accepted" in text


def test_a_pickle_named_safetensors_is_refused_as_a_pickle(tmp_path: Path) -> None:
    files = {**adapter_files(tmp_path), "adapter_model.safetensors": pickle.dumps({"weights": [1.0]})}
    assert "is a PyTorch pickle" in refusal(tmp_path, archive(files))
    files["adapter_model.safetensors"] = b"PK\x03\x04" + b"\0" * 100  # torch.save's zip format
    assert "is a PyTorch pickle" in refusal(tmp_path, archive(files))


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda raw: raw[:-10], "does not fit its data"),
    (lambda raw: raw + b"\0" * 8, "bytes past its last tensor"),
    (lambda raw: struct.pack("<Q", 1 << 40) + raw[8:], "its header claims"),
    (lambda raw: raw[:8] + b"{" * 20 + raw[28:], "its header is not JSON"),
    (lambda raw: raw[:3], "shorter than a safetensors header"),
], ids=["truncated", "padded", "huge-header", "garbled-header", "stub"])
def test_a_corrupted_weights_file_is_refused_as_not_safetensors(tmp_path: Path, corrupt: Any, message: str) -> None:
    files = adapter_files(tmp_path)
    files["adapter_model.safetensors"] = corrupt(files["adapter_model.safetensors"])
    text = refusal(tmp_path, archive(files))
    assert "is not a valid safetensors file" in text and message in text


def test_an_upload_that_is_no_tar_is_refused(tmp_path: Path) -> None:
    assert "not a readable tar archive" in refusal(tmp_path, b"this is not a tar archive" * 100)
    assert "not a readable tar archive" in refusal(tmp_path, gzip.compress(b"neither")[:-4])


def test_an_archive_unpacking_past_the_limit_is_refused(tmp_path: Path) -> None:
    data = archive({**adapter_files(tmp_path), "big.txt": b"\0" * 100_000}, compress=True)
    assert len(data) < 100_000
    assert "unpacks to more than 50000 bytes" in refusal(tmp_path, data, max_bytes=50_000)


def test_a_foreign_shape_is_refused_with_the_shapes_the_base_model_needs(tmp_path: Path) -> None:
    foreign = {name: (out * 2, inp * 2) for name, (out, inp) in ATTENTION.items()}  # a wider model's adapter
    text = refusal(tmp_path, archive(adapter_files(tmp_path, tensors=lora_tensors(foreign))))
    assert "model.layers.0.self_attn.q_proj" in text and "lora_A [4, 128]" in text
    assert "must be [4, 64] and [64, 4]" in text and "another base model" in text


def test_a_module_the_base_model_lacks_is_refused(tmp_path: Path) -> None:
    tensors = lora_tensors({"model.layers.7.self_attn.q_proj": (HIDDEN, HIDDEN)})
    text = refusal(tmp_path, archive(adapter_files(tmp_path, tensors=tensors)))
    assert "'model.layers.7.self_attn.q_proj', which tiny-qwen does not have" in text


def test_a_target_module_the_base_model_lacks_is_refused(tmp_path: Path) -> None:
    config = {**PEFT_CONFIG, "target_modules": ["q_proj", "v_proj", "query_key_value"]}
    text = refusal(tmp_path, archive(adapter_files(tmp_path, config)))
    assert "Target module 'query_key_value'" in text and "does not exist in tiny-qwen" in text


def test_tensors_the_config_does_not_target_are_refused(tmp_path: Path) -> None:
    config = {**PEFT_CONFIG, "target_modules": ["q_proj"]}
    assert "which the target_modules of adapter_config.json do not name" in refusal(
        tmp_path, archive(adapter_files(tmp_path, config)))


def test_a_rank_other_than_the_configs_is_refused(tmp_path: Path) -> None:
    text = refusal(tmp_path, archive(adapter_files(tmp_path, {**PEFT_CONFIG, "r": 8})))
    assert "do not have the config's rank r=8" in text
    half = lora_tensors(ATTENTION)
    half["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = np.zeros((HIDDEN, 2), np.float32)
    assert "lora_B [64, 2]" in refusal(tmp_path, archive(adapter_files(tmp_path, tensors=half)))


def test_a_module_without_its_lora_b_is_refused(tmp_path: Path) -> None:
    tensors = lora_tensors(ATTENTION)
    del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert "'model.layers.1.self_attn.v_proj' has no lora_B weight" in refusal(
        tmp_path, archive(adapter_files(tmp_path, tensors=tensors)))


@pytest.mark.parametrize(("extra", "message"), [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding layer"),
    ("base_model.model.lm_head.base_layer.weight", "save_embedding_layers=False"),
    ("base_model.model.model.norm.weight", "Only lora_A and lora_B weights"),
])
def test_tensors_that_are_not_lora_weights_are_refused_with_what_they_are(tmp_path: Path, extra: str,
                                                                            message: str) -> None:
    tensors = {**lora_tensors(ATTENTION), extra: np.zeros((4,), np.float32)}
    text = refusal(tmp_path, archive(adapter_files(tmp_path, tensors=tensors)))
    assert repr(extra) in text and message in text


@pytest.mark.parametrize("dtype", [np.float64, np.int8])
def test_dtypes_other_than_float32_float16_bfloat16_are_refused(tmp_path: Path, dtype: Any) -> None:
    text = refusal(tmp_path, archive(adapter_files(tmp_path, tensors=lora_tensors(ATTENTION, dtype=dtype))))
    assert "adapters are imported in F32, F16, BF16 only" in text


def test_non_finite_values_are_refused_when_the_checkpoint_is_written(tmp_path: Path) -> None:
    tensors = lora_tensors(ATTENTION)
    tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"][1, 2] = np.nan
    upload = parse(tmp_path, archive(adapter_files(tmp_path, tensors=tensors)))
    spec = adapter_import.check_against_base(upload, SHAPES, "tiny-qwen")
    with pytest.raises(InvalidRequest, match=r"v_proj\.lora_A\.weight' holds NaN or infinite values"):
        adapter_import.write_adapter(upload, spec, "tiny-qwen", tmp_path)


def test_bfloat16_infinities_are_found_by_their_bits(tmp_path: Path) -> None:
    tensors = lora_tensors(ATTENTION)
    header = {name: {"dtype": "BF16", "shape": list(v.shape)} for name, v in tensors.items()}
    data, position = b"", 0
    for name, value in tensors.items():
        raw = (value.view(np.uint32) >> 16).astype("<u2")
        if name.endswith("q_proj.lora_B.weight"):
            raw[0, 0] = 0x7F80  # +inf in bfloat16
        header[name]["data_offsets"] = [position, position + raw.nbytes]
        position += raw.nbytes
        data += raw.tobytes()
    encoded = json.dumps(header).encode()
    files = {**adapter_files(tmp_path), "adapter_model.safetensors": struct.pack("<Q", len(encoded)) + encoded + data}
    upload = parse(tmp_path, archive(files))
    spec = adapter_import.check_against_base(upload, SHAPES, "tiny-qwen")
    with pytest.raises(InvalidRequest, match="NaN or infinite"):
        adapter_import.write_adapter(upload, spec, "tiny-qwen", tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, "DoRA (use_dora)"),
    ({"use_rslora": True}, "use_rslora"),
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"r": 0}, "r must be an integer from 1 to 1024"),
    ({"r": 4.5}, "r must be an integer"),
    ({"lora_alpha": -1}, "lora_alpha must be a positive number"),
    ({"lora_dropout": 1.5}, "lora_dropout must be in [0, 1)"),
    ({"peft_type": "IA3"}, "'IA3' adapter; only LoRA adapters"),
])
def test_configs_twinkles_lora_cannot_compute_are_refused_by_option(tmp_path: Path, change: dict[str, Any],
                                                                    message: str) -> None:
    text = refusal(tmp_path, archive(adapter_files(tmp_path, {**PEFT_CONFIG, **change})))
    assert message in text


def test_a_config_that_is_not_json_is_refused(tmp_path: Path) -> None:
    files = {**adapter_files(tmp_path), "adapter_config.json": b"{not json"}
    assert "adapter_config.json is not valid JSON" in refusal(tmp_path, archive(files))


def catalog() -> Catalog:
    return Catalog(parse_config({"applications": [
        {"name": "m", "route_prefix": "/api/v1/model/x", "import_path": "model",
         "args": {"backend": "transformers", "model_id": "/srv/models/tiny-qwen", "served_model_name": "tiny-qwen"}}]}))


def test_the_base_model_is_matched_by_name_path_or_hub_id() -> None:
    served = catalog()
    for declared in ("tiny-qwen", "/home/someone/models/tiny-qwen/", "/srv/models/tiny-qwen", "hf://org/tiny-qwen"):
        assert adapter_import.find_base_model(served, None, declared).name == "tiny-qwen"
    assert adapter_import.find_base_model(served, "tiny-qwen", "Qwen/Qwen3-8B").name == "tiny-qwen"  # explicit wins


def test_an_adapter_for_a_model_not_served_here_is_refused_naming_both() -> None:
    with pytest.raises(InvalidRequest) as error:
        adapter_import.find_base_model(catalog(), None, "meta-llama/Llama-3.1-8B")
    assert "trained on 'meta-llama/Llama-3.1-8B'" in str(error.value) and "Served models: tiny-qwen" in str(error.value)
    assert "base_model=" in (error.value.hint or "")
    with pytest.raises(InvalidRequest, match="names no base model"):
        adapter_import.find_base_model(catalog(), None, None)
    with pytest.raises(InvalidRequest, match="'llama' is not served here"):
        adapter_import.find_base_model(catalog(), "llama", "tiny-qwen")
