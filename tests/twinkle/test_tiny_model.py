from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
)

from twinkle import tiny_model
from twinkle.errors import InvalidRequest
from twinkle.tiny_model import (
    BUILD_RECORD_NAME,
    SPECIAL_TOKENS,
    VISION_IMAGE_TOKENS,
    build_tiny_model,
    ensure_tiny_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = [
    {"role": "system", "content": "You are Twinkle."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
]


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> str:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(rendered, str)
    return rendered


def test_text_model_loads_with_auto_classes_and_agrees_with_its_tokenizer(text_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    generation = GenerationConfig.from_pretrained(text_model_dir)

    assert model.config.model_type in ("qwen2", "qwen3")
    assert model.config.tie_word_embeddings is False
    assert model.config.vocab_size == 512 >= len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == generation.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == generation.pad_token_id == tokenizer.pad_token_id
    assert all(tokenizer.get_vocab()[token] < len(tokenizer) for token in SPECIAL_TOKENS)
    weights = load_file(text_model_dir / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_tokenizer_round_trips_english_chinese_and_special_tokens(text_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    text = "Hello, Twinkle! 你好，世界。 Ellohay orldway: 12 + 30 = 42.\n\n  indented\tand emoji 🙂"

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges learned from the corpus, not one token per byte
    marked = "<|im_start|>user\nhi<|im_end|>"
    marked_ids = tokenizer(marked, add_special_tokens=False)["input_ids"]
    assert marked_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert marked_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(marked_ids) == marked


def test_chat_template_renders_chatml_and_the_generation_prompt(text_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)

    rendered = _render(tokenizer, CONVERSATION)
    prompt = _render(tokenizer, CONVERSATION[:2], add_generation_prompt=True)

    assert rendered == (
        "<|im_start|>system\nYou are Twinkle.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n"
    )
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert not _render(tokenizer, CONVERSATION[:2]).endswith("assistant\n")


def test_forward_pass_gives_logits_over_the_vocab_for_every_position(text_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    batch = tokenizer(["The cat sat on the mat.", "你好"], return_tensors="pt", padding=True)

    with torch.no_grad():
        logits = model(**batch).logits

    assert logits.shape == (2, batch["input_ids"].shape[1], 512)
    assert torch.isfinite(logits).all()


def test_lora_adapter_on_the_tiny_model_lowers_the_loss_on_repeated_data(text_model_dir: Path) -> None:
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(model, config)
    batch = tokenizer(["Question: 2 + 3? Answer: 5."], return_tensors="pt")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    losses = []
    for _ in range(8):
        loss = model(**batch, labels=batch["input_ids"]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    assert losses[-1] < losses[0] - 0.1


def test_two_builds_with_the_same_arguments_are_byte_identical(text_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")

    assert _files(again) == _files(text_model_dir)


@pytest.mark.slow  # a fresh interpreter must import torch and transformers
def test_a_build_in_another_process_with_other_threads_and_hash_seed_is_byte_identical(
    text_model_dir: Path, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "PYTHONHASHSEED": "12345",
        "RAYON_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    script = "import sys; from twinkle.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1])"

    subprocess.run([sys.executable, "-c", script, str(tmp_path / "other")], env=env, check=True, timeout=120)

    assert _files(tmp_path / "other") == _files(text_model_dir)


def test_a_different_seed_gives_different_weights_but_the_same_tokenizer(text_model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "seed1", seed=1)

    assert (other / "tokenizer.json").read_bytes() == (text_model_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (text_model_dir / "model.safetensors").read_bytes()


def test_build_args_shape_the_model(tmp_path: Path) -> None:
    directory = build_tiny_model(
        tmp_path / "wide", vocab_size=300, hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3
    )

    config = AutoConfig.from_pretrained(directory)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (300, 96, 3)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 3, 16)
    assert len(AutoTokenizer.from_pretrained(directory)) <= 300


def test_the_text_build_takes_well_under_five_seconds(tmp_path: Path) -> None:
    started = time.perf_counter()
    build_tiny_model(tmp_path / "timed")

    assert time.perf_counter() - started < 5.0


def test_ensure_reuses_a_matching_build_without_rebuilding(
    text_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse_to_build(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("ensure_tiny_model rebuilt a directory it should have reused")

    monkeypatch.setattr(tiny_model, "_write_model", refuse_to_build)

    assert ensure_tiny_model(text_model_dir) == text_model_dir
    assert ensure_tiny_model(text_model_dir, vocab_size=512, seed=0) == text_model_dir


def test_ensure_rebuilds_when_the_arguments_change(tmp_path: Path) -> None:
    directory = ensure_tiny_model(tmp_path / "model", seed=0)
    first_weights = (directory / "model.safetensors").read_bytes()

    ensure_tiny_model(directory, seed=1)

    record = json.loads((directory / BUILD_RECORD_NAME).read_text())
    assert record["args"]["seed"] == 1
    assert (directory / "model.safetensors").read_bytes() != first_weights
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model.")] == [".model.lock"]


def test_concurrent_ensure_calls_build_once_and_leave_a_complete_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[Path] = []
    write_model = tiny_model._write_model

    def counting_write_model(directory: Path, spec: tiny_model.TinyModelSpec) -> None:
        builds.append(directory)
        write_model(directory, spec)

    monkeypatch.setattr(tiny_model, "_write_model", counting_write_model)
    target = tmp_path / "shared"

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: ensure_tiny_model(target), range(4)))

    assert results == [target] * 4
    assert len(builds) == 1
    assert AutoModelForCausalLM.from_pretrained(target).config.vocab_size == 512


def test_a_directory_that_is_not_a_tiny_model_is_never_replaced(tmp_path: Path) -> None:
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")

    with pytest.raises(InvalidRequest, match="holds no tiny model"):
        ensure_tiny_model(tmp_path)

    assert keep.read_text() == "mine"


def test_an_empty_existing_directory_is_filled(tmp_path: Path) -> None:
    assert build_tiny_model(tmp_path) == tmp_path
    assert (tmp_path / BUILD_RECORD_NAME).exists()


@pytest.mark.parametrize(
    "bad_args",
    [{"vocab_size": 100}, {"hidden_size": 62}, {"num_heads": 4, "num_kv_heads": 3}, {"num_layers": 0}],
)
def test_impossible_shapes_are_refused_with_a_hint(tmp_path: Path, bad_args: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        build_tiny_model(tmp_path / "bad", **bad_args)

    assert not (tmp_path / "bad").exists()


def test_ensure_rejects_a_misspelt_argument(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="hidden_sise"):
        ensure_tiny_model(tmp_path / "bad", hidden_sise=64)


def test_vision_model_turns_a_chat_with_an_image_into_logits(tmp_path: Path) -> None:
    image_module = pytest.importorskip("PIL.Image")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    directory = build_tiny_model(tmp_path / "vlm", vision=True)
    processor = AutoProcessor.from_pretrained(directory)  # type: ignore[no-untyped-call]
    model = AutoModelForImageTextToText.from_pretrained(directory)
    messages = [
        {"role": "system", "content": "You are Twinkle."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = image_module.new("RGB", (90, 60), (200, 30, 30))

    inputs = processor(text=[text], images=[image], return_tensors="pt")
    started = time.perf_counter()
    with torch.no_grad():
        logits = model(**inputs).logits
    elapsed = time.perf_counter() - started

    assert "<|vision_start|><|image_pad|><|vision_end|>What colour is this?" in text
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_token_id).sum()) == VISION_IMAGE_TOKENS
    assert logits.shape == (1, inputs["input_ids"].shape[1], 512)
    assert torch.isfinite(logits).all()
    assert elapsed < 1.0


def test_vision_build_is_deterministic_and_its_image_features_reach_the_logits(tmp_path: Path) -> None:
    image_module = pytest.importorskip("PIL.Image")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    first = build_tiny_model(tmp_path / "a", vision=True)
    second = build_tiny_model(tmp_path / "b", vision=True)
    assert _files(first) == _files(second)

    processor = AutoProcessor.from_pretrained(first)  # type: ignore[no-untyped-call]
    model = AutoModelForImageTextToText.from_pretrained(first)
    text = "<|vision_start|><|image_pad|><|vision_end|>colour?"
    red, blue = (image_module.new("RGB", (56, 56), colour) for colour in ((255, 0, 0), (0, 0, 255)))
    with torch.no_grad():
        red_logits = model(**processor(text=[text], images=[red], return_tensors="pt")).logits
        blue_logits = model(**processor(text=[text], images=[blue], return_tensors="pt")).logits

    assert not torch.allclose(red_logits[0, -1], blue_logits[0, -1])
