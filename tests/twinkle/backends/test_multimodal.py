"""Images on a vision-language model: the tiny LLaVA (Qwen3 text model behind a SigLIP tower), on CPU.

Each image is a solid colour; an adapter learns to answer with the colour's name, which it can only do
by reading the image.
"""

from __future__ import annotations

import base64
import io
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from twinkle.backends.transformers_backend import TransformersBackend
from twinkle.data_format import Message, Trajectory
from twinkle.errors import InvalidRequest
from twinkle.samplers.torch_sampler import TorchSampler
from twinkle.template import Template
from twinkle.tiny_model import IMAGE_PAD, VISION_IMAGE_TOKENS, build_tiny_model
from twinkle.types import (
    AdamParams,
    Chunk,
    Datum,
    ForwardBackwardInput,
    ImageChunk,
    LoraSpec,
    SampleRequest,
    SamplingParams,
    TextChunk,
    chunks_from_tokens,
)
from workers.twinkle_ops import datum_of

TEST_DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")
COLOURS = {"red": (230, 20, 20), "blue": (20, 20, 230), "green": (20, 200, 20)}
QUESTION = "What colour is this?"
# Every seed tried (0-5) learns all three captions in 40 steps at this rate.
STEP = AdamParams(learning_rate=5e-3, grad_clip_norm=1.0)


def image_bytes(colour: tuple[int, int, int], image_format: str = "PNG", size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=image_format)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llava", vision=True)


@pytest.fixture(scope="module")
def vlm(vlm_dir: Path) -> TransformersBackend:
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest (see conftest)
    return TransformersBackend(str(vlm_dir), torch_dtype="float32", device=TEST_DEVICE)


@dataclass
class Chat:
    """Tinker-style inputs for `<user>[image] question</user><assistant>answer</assistant>`."""

    encode: Callable[[str], list[int]]

    def before_image(self) -> list[int]:
        return self.encode("<|im_start|>user\n<|vision_start|>")

    def after_image(self) -> list[int]:
        return self.encode(f"<|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n")

    def prompt(self, image: bytes, expected_tokens: int | None = None) -> list[Chunk]:
        return [
            TextChunk(np.asarray(self.before_image(), np.int64)),
            ImageChunk(image, "png", expected_tokens),
            TextChunk(np.asarray(self.after_image(), np.int64)),
        ]

    def datum(self, image: bytes, answer: str, expected_tokens: int | None = VISION_IMAGE_TOKENS) -> Datum:
        """Cross entropy on the answer and its end-of-turn token; the image takes VISION_IMAGE_TOKENS positions."""
        before, after, reply = self.before_image(), self.after_image(), self.encode(answer + "<|im_end|>")
        sequence = [*before, *[0] * VISION_IMAGE_TOKENS, *after, *reply]  # image ids never become targets here
        weights = np.zeros(len(sequence) - 1, np.float32)
        weights[-len(reply) :] = 1.0
        chunks = self.prompt(image, expected_tokens)
        chunks[-1] = TextChunk(np.asarray([*after, *reply[:-1]], np.int64))
        return Datum(chunks, {"target_tokens": np.asarray(sequence[1:], np.int64), "weights": weights})


@pytest.fixture(scope="module")
def chat(vlm: TransformersBackend) -> Chat:
    tokenizer = vlm.shared.base.tokenizer
    return Chat(lambda text: list(tokenizer.encode(text, add_special_tokens=False)))


@dataclass
class Captioner:
    losses: list[float]
    sampler_weights: Path


@pytest.fixture(scope="module")
def captioner(vlm: TransformersBackend, chat: Chat, tmp_path_factory: pytest.TempPathFactory) -> Captioner:
    """An adapter trained to name the colour of each image (one of them sent as JPEG)."""
    data = [chat.datum(image_bytes(rgb, "JPEG" if name == "green" else "PNG"), name) for name, rgb in COLOURS.items()]
    vlm.create_adapter("captioner", LoraSpec(rank=8, seed=0))
    losses = []
    for _ in range(40):
        losses.append(vlm.forward_backward("captioner", ForwardBackwardInput(data)).metrics["loss:sum"])
        vlm.optim_step("captioner", STEP)
    weights = tmp_path_factory.mktemp("captioner") / "sampler"
    vlm.save_weights_for_sampler("captioner", weights)
    return Captioner(losses, weights)


def greedy(prompt: list[Chunk], **options: object) -> SampleRequest:
    return SampleRequest(prompt, SamplingParams(max_tokens=8, temperature=0.0), **options)  # type: ignore[arg-type]


def answer_logprobs(backend: TransformersBackend, adapter_id: str, data: list[Datum]) -> list[np.ndarray]:
    outputs = backend.forward(adapter_id, ForwardBackwardInput(data)).loss_fn_outputs
    return [
        output["logprobs"][datum.loss_fn_inputs["weights"] > 0] for output, datum in zip(outputs, data, strict=True)
    ]


# Loading


def test_a_vision_language_model_loads_with_its_processor_and_lora_on_the_language_model_only(
    vlm: TransformersBackend,
) -> None:
    assert vlm.shared.base.images.enabled
    assert vlm.info.arch == "LlavaForConditionalGeneration"
    assert vlm.info.max_context_length == 2048  # from the text config
    vlm.create_adapter("layout", LoraSpec(rank=2, target_modules="all-linear"))
    tenant = vlm.tenants["layout"].name
    try:
        names = [name for name, _ in vlm.shared.peft.named_parameters() if f".{tenant}." in name]  # type: ignore[union-attr]
        assert any("language_model" in name for name in names)
        assert not [name for name in names if "vision_tower" in name or "multi_modal_projector" in name]
    finally:
        vlm.remove_adapter("layout")


# Training through ImageChunks (the Tinker path)


def test_training_on_image_caption_pairs_lowers_the_loss(captioner: Captioner) -> None:
    assert captioner.losses[-1] < 0.1 * captioner.losses[0]


def test_the_trained_adapter_names_each_image_colour_when_sampling(
    vlm: TransformersBackend, vlm_dir: Path, chat: Chat, captioner: Captioner
) -> None:
    prompts = [chat.prompt(image_bytes(rgb)) for rgb in COLOURS.values()]
    tokenizer = vlm.shared.base.tokenizer
    expected = [f"{name}<|im_end|>" for name in COLOURS]
    from_backend = vlm.sample("captioner", [greedy(prompt, prompt_logprobs=True) for prompt in prompts])
    assert [tokenizer.decode(output.sequences[0].tokens) for output in from_backend] == expected
    prompt_length = len(chat.before_image()) + VISION_IMAGE_TOKENS + len(chat.after_image())
    assert all(len(output.prompt_logprobs or []) == prompt_length for output in from_backend)
    assert all(output.prompt_length == prompt_length for output in from_backend)

    sampler = TorchSampler(str(vlm_dir), torch_dtype="float32", device=TEST_DEVICE)
    # The adapter's requests and a base-model request share one mixed batch.
    requests = [greedy(prompt, adapter_path=str(captioner.sampler_weights)) for prompt in prompts]
    from_sampler = sampler.sample([*requests, greedy(prompts[0])])
    assert [tokenizer.decode(output.sequences[0].tokens) for output in from_sampler[:3]] == expected
    assert tokenizer.decode(from_sampler[3].sequences[0].tokens) != expected[0]


def test_different_images_give_different_logprobs_and_the_same_image_the_same(
    vlm: TransformersBackend, chat: Chat
) -> None:
    vlm.create_adapter("looker", LoraSpec(rank=2, seed=1))
    red, blue = image_bytes(COLOURS["red"]), image_bytes(COLOURS["blue"])
    first, second, third = answer_logprobs(
        vlm, "looker", [chat.datum(red, "red"), chat.datum(red, "red"), chat.datum(blue, "red")]
    )
    np.testing.assert_array_equal(first, second)
    assert np.abs(first - third).max() > 1e-3


def test_losses_reading_the_reference_policy_give_it_the_images_too(vlm: TransformersBackend, chat: Chat) -> None:
    # A fresh adapter is the reference policy (LoRA B starts at zero), so each DPO pair's loss is log 2,
    # unless the reference forward misses the images.
    vlm.create_adapter("preferences", LoraSpec(rank=2, seed=2))
    red, blue = image_bytes(COLOURS["red"]), image_bytes(COLOURS["blue"])
    pairs = [chat.datum(red, "red"), chat.datum(red, "blue"), chat.datum(blue, "blue"), chat.datum(blue, "red")]
    loss = vlm.forward_backward("preferences", ForwardBackwardInput(pairs, "dpo")).metrics["loss:sum"]
    assert loss == pytest.approx(2 * math.log(2), abs=1e-5)


# InputFeatures from the template (the Twinkle path)


def image_trajectory(image: bytes, answer: str) -> Trajectory:
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    return Trajectory(messages=[Message("user", QUESTION, images=[uri]), Message("assistant", answer)])


def test_an_image_chunk_and_the_templates_input_feature_give_the_same_logprobs(
    vlm: TransformersBackend, vlm_dir: Path
) -> None:
    image = image_bytes(COLOURS["green"], size=(70, 50))
    feature = Template(vlm_dir).encode(image_trajectory(image, "green"))
    from_feature = datum_of(dict(feature))
    assert set(from_feature.loss_fn_inputs) == {"target_tokens", "weights", "pixel_values"}
    tokens = from_feature.tokens()
    assert vlm.shared.base.images.image_token == IMAGE_PAD
    slots = np.flatnonzero(tokens == vlm.shared.base.images.image_token_id)
    start, stop = int(slots[0]), int(slots[-1]) + 1
    chunks: list[Chunk] = [TextChunk(tokens[:start]), ImageChunk(image, "png"), TextChunk(tokens[stop:])]
    inputs = {key: from_feature.loss_fn_inputs[key] for key in ("target_tokens", "weights")}
    from_chunks = Datum(chunks, inputs)

    vlm.create_adapter("paths", LoraSpec(rank=2, seed=3))
    feature_lp, chunk_lp = answer_logprobs(vlm, "paths", [from_feature, from_chunks])
    np.testing.assert_allclose(feature_lp, chunk_lp, atol=1e-5)


def test_the_twinkle_path_trains_on_input_features_with_pixel_values(vlm: TransformersBackend, vlm_dir: Path) -> None:
    template = Template(vlm_dir)
    data = [datum_of(dict(template.encode(image_trajectory(image_bytes(rgb), name)))) for name, rgb in COLOURS.items()]
    vlm.create_adapter("twinkle", LoraSpec(rank=8, seed=4))
    losses = []
    for _ in range(10):
        losses.append(vlm.forward_backward("twinkle", ForwardBackwardInput(data)).metrics["loss:sum"])
        vlm.optim_step("twinkle", STEP)
    assert losses[-1] < 0.5 * losses[0]


# Sampling


def test_sampling_several_image_prompts_on_the_base_model_reads_each_image(vlm_dir: Path, chat: Chat) -> None:
    sampler = TorchSampler(str(vlm_dir), torch_dtype="float32", device=TEST_DEVICE)
    red, blue = image_bytes(COLOURS["red"]), image_bytes(COLOURS["blue"])
    outputs = sampler.sample(
        [
            SampleRequest(chat.prompt(red), SamplingParams(max_tokens=3, seed=5), num_samples=2, prompt_logprobs=True),
            SampleRequest(chat.prompt(blue, VISION_IMAGE_TOKENS), SamplingParams(max_tokens=3), prompt_logprobs=True),
        ]
    )
    assert [len(output.sequences) for output in outputs] == [2, 1]
    assert all(len(sequence.tokens) == 3 for output in outputs for sequence in output.sequences)
    red_lp, blue_lp = (np.asarray(output.prompt_logprobs[1:], np.float64) for output in outputs)  # type: ignore[index]
    text_after = len(chat.after_image())
    assert np.abs(red_lp[-text_after:] - blue_lp[-text_after:]).max() > 1e-3


# Mistakes


def test_a_wrong_expected_tokens_is_refused_naming_both_counts(vlm: TransformersBackend, chat: Chat) -> None:
    vlm.create_adapter("miscounted", LoraSpec(rank=2))
    datum = chat.datum(image_bytes(COLOURS["red"]), "red", expected_tokens=10)
    with pytest.raises(InvalidRequest, match=f"expected_tokens=10.* {VISION_IMAGE_TOKENS} tokens") as raised:
        vlm.forward("miscounted", ForwardBackwardInput([datum]))
    assert raised.value.details == {"expected_tokens": 10, "image_tokens": VISION_IMAGE_TOKENS}
    with pytest.raises(InvalidRequest, match="expected_tokens=10"):
        vlm.sample(None, [greedy(chat.prompt(image_bytes(COLOURS["red"]), expected_tokens=10))])


def test_undecodable_image_bytes_are_an_invalid_request(vlm: TransformersBackend, chat: Chat) -> None:
    with pytest.raises(InvalidRequest, match="request 0 image 0 cannot be decoded as png"):
        vlm.sample(None, [greedy(chat.prompt(b"not an image"))])


def test_image_tokens_without_pixel_values_are_an_invalid_request(vlm: TransformersBackend, vlm_dir: Path) -> None:
    vlm.create_adapter("pixelless", LoraSpec(rank=2))
    datum = datum_of(dict(Template(vlm_dir).encode(image_trajectory(image_bytes(COLOURS["red"]), "red"))))
    del datum.loss_fn_inputs["pixel_values"]
    with pytest.raises(InvalidRequest, match=f"{VISION_IMAGE_TOKENS} image tokens .* but no pixel_values"):
        vlm.forward("pixelless", ForwardBackwardInput([datum]))


def test_a_text_only_model_refuses_images_clearly(
    make_backend: Callable[..., TransformersBackend], tiny_model_dir: Path, chat: Chat
) -> None:
    backend = make_backend()
    assert not backend.shared.base.images.enabled
    backend.create_adapter("a", LoraSpec(rank=2))
    with pytest.raises(InvalidRequest, match=r"datum 0 holds images, but .* reads text only"):
        backend.forward("a", ForwardBackwardInput([chat.datum(image_bytes(COLOURS["red"]), "red")]))
    feature_like = Datum(
        chunks_from_tokens([1, 2]),
        {"target_tokens": np.array([2, 3]), "pixel_values": np.zeros((1, 3, 56, 56), np.float32)},
    )
    with pytest.raises(InvalidRequest, match="reads text only"):
        backend.forward_backward("a", ForwardBackwardInput([feature_like]))
    sampler = TorchSampler.sharing(backend)
    with pytest.raises(InvalidRequest, match=r"request 0 holds images, but .* reads text only"):
        sampler.sample([greedy(chat.prompt(image_bytes(COLOURS["red"])))])


def test_a_vision_language_model_without_its_image_processor_trains_on_text_and_says_why_images_fail(
    vlm_dir: Path, tmp_path: Path, chat: Chat
) -> None:
    without_processor = shutil.copytree(vlm_dir, tmp_path / "no-processor")
    (without_processor / "processor_config.json").unlink()
    backend = TransformersBackend(str(without_processor), torch_dtype="float32", device=TEST_DEVICE)
    assert not backend.shared.base.images.enabled
    backend.create_adapter("a", LoraSpec(rank=2))
    text = Datum(chunks_from_tokens([1, 20, 30, 40]), {"target_tokens": np.array([20, 30, 40, 2])})
    assert backend.forward_backward("a", ForwardBackwardInput([text])).metrics["loss:sum"] > 0
    with pytest.raises(InvalidRequest, match="this server has no image processor"):
        backend.forward("a", ForwardBackwardInput([chat.datum(image_bytes(COLOURS["red"]), "red")]))
