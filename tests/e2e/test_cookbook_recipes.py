"""Acceptance: the Tinker SDK calls tinker-cookbook 0.6.1's recipes make, unmodified, against a launched server.

tinker-cookbook itself does not install from the package index (it pins `tml-renderers>=0.4.1`, which the
index does not have), so each test replays the SDK calls of one recipe, in the recipe's order and with its
arguments, with the data loading replaced by a few local rows of the tiny model's tokenizer:

- supervised `train` / `sl_loop`: cross_entropy on renderer-style (tokens, weights) datums, AdamW with the
  recipe's betas, `checkpoint_utils.save_checkpoint` (save_state + save_weights_for_sampler with a TTL),
  resume with `create_training_client_from_state_with_optimizer`.
- `preference/train_dpo`: reference logprobs from `save_weights_and_get_sampling_client().compute_logprobs`,
  the DPO loss through `forward_backward_custom`.
- `math_rl` (arithmetic env) and `rl/train` with the default loss `stable_reinforce`: sampling with
  `record_stability_info=True`, datums carrying provenance spans that name each `sequence_id`.
- `rl_loop`: the same with `gspo` (and its `sequence_ratio_mask`), `importance_sampling` and `cispo`.
- checkpoint utilities: the RestClient calls `checkpoint_utils` makes (training run by tinker path, list,
  delete), and `weights.download` of an external export (signed URLs), loaded with PEFT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import TensorData, types

from tests.harness import LaunchedServer

pytestmark = pytest.mark.e2e
BASE = "tiny-qwen"
KEY = "tml-cookbook-acceptance"
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.fixture(scope="module")
def service(server: LaunchedServer) -> Iterator[tinker.ServiceClient]:
    yield tinker.ServiceClient(base_url=server.base_url, api_key=KEY)


@pytest.fixture(scope="module")
def training(service: tinker.ServiceClient) -> tinker.TrainingClient:
    return service.create_lora_training_client(
        base_model=BASE, rank=8, user_metadata={"renderer_name": "qwen3"}).result()


def supervised_datum(tokenizer: Any, prompt: str, completion: str) -> types.Datum:
    """What `renderer.build_supervised_example` + `datum_from_model_input_weights` produce."""
    prompt_tokens = tokenizer.encode(prompt)
    tokens = prompt_tokens + tokenizer.encode(completion)
    weights = [0.0] * len(prompt_tokens) + [1.0] * (len(tokens) - len(prompt_tokens))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": TensorData.from_torch(torch.tensor(tokens[1:])),
                        "weights": TensorData.from_torch(torch.tensor(weights[1:]))},
    )


def test_supervised_train_and_sl_loop_train_save_and_resume(
    service: tinker.ServiceClient, training: tinker.TrainingClient
) -> None:
    tokenizer = training.get_tokenizer()
    rows = [("What is 2+2?", " 4"), ("Name a colour.", " blue"), ("Say hi.", " hi there")]
    batch = [supervised_datum(tokenizer, p, c) for p, c in rows]
    losses = []
    for _ in range(2):
        fwd_bwd = training.forward_backward(batch, loss_fn="cross_entropy")
        optim = training.optim_step(ADAM)
        result = fwd_bwd.result()
        optim.result()
        logprobs = np.concatenate([out["logprobs"].to_numpy() for out in result.loss_fn_outputs])
        weights = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in batch])
        losses.append(float(-(logprobs * weights).sum() / weights.sum()))  # the recipe's train_mean_nll
    assert losses[1] < losses[0]

    # checkpoint_utils.save_checkpoint(kind="both", ttl_seconds=...)
    state = training.save_state("000002", ttl_seconds=3600)
    sampler = training.save_weights_for_sampler("000002", ttl_seconds=3600)
    state_path, sampler_path = state.result().path, sampler.result().path
    assert state_path.startswith("tinker://") and "/weights/" in state_path
    assert "/sampler_weights/" in sampler_path

    resumed = service.create_training_client_from_state_with_optimizer(state_path)
    again = resumed.forward(batch, loss_fn="cross_entropy").result()
    np.testing.assert_allclose(again.loss_fn_outputs[0]["logprobs"].to_numpy(),
                               training.forward(batch, loss_fn="cross_entropy").result()
                               .loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=1e-5, atol=1e-6)
    sampled = service.create_sampling_client(model_path=sampler_path).sample(
        types.ModelInput.from_ints(tokenizer.encode("Say hi.")), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=3, temperature=1.0)).result()
    assert len(sampled.sequences[0].tokens) >= 1


def test_dpo_takes_reference_logprobs_from_a_sampling_client_and_trains_with_a_custom_loss(
    training: tinker.TrainingClient,
) -> None:
    tokenizer = training.get_tokenizer()
    reference_client = training.save_weights_and_get_sampling_client()
    pairs = [("Q: 1+1?", " 2", " 3"), ("Q: capital of France?", " Paris", " Rome")]
    data: list[types.Datum] = []
    full_sequences = []
    for prompt, chosen, rejected in pairs:
        for completion in (chosen, rejected):
            datum = supervised_datum(tokenizer, prompt, completion)
            data.append(datum)
            full_sequences.append(datum.model_input.append_int(int(datum.loss_fn_inputs["target_tokens"].data[-1])))
    reference_logprobs = [reference_client.compute_logprobs(seq).result()[1:] for seq in full_sequences]
    assert all(len(lp) == d.model_input.length for lp, d in zip(reference_logprobs, data, strict=True))
    assert all(all(v is not None for v in lp) for lp in reference_logprobs)

    beta = 0.1

    def dpo_loss_fn(batch: list[types.Datum], logprobs_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        rewards = []
        for datum, logprobs, ref in zip(batch, logprobs_list, reference_logprobs, strict=True):
            weights = datum.loss_fn_inputs["weights"].to_torch()
            rewards.append((weights * (logprobs - torch.tensor(ref))).sum())
        chosen, rejected = torch.stack(rewards[0::2]), torch.stack(rewards[1::2])
        loss = -torch.nn.functional.logsigmoid(beta * (chosen - rejected)).mean()
        return loss, {"dpo_loss": loss.item()}

    result = training.forward_backward_custom(data, dpo_loss_fn).result()
    training.optim_step(ADAM).result()
    assert result.metrics["dpo_loss"] == pytest.approx(np.log(2), rel=0.05)  # the policy starts at the reference


def sampled_group(training: tinker.TrainingClient, prompt: list[int], *, record: bool,
                  group_size: int = 4) -> types.SampleResponse:
    sampling_client = training.save_weights_and_get_sampling_client(record_stability_info=record)
    return sampling_client.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=group_size,
                                  sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0)).result()


def rl_datums(prompt: list[int], response: types.SampleResponse, loss_fn: str) -> list[types.Datum]:
    """rl_loop's datum construction, provenance included for stable_reinforce and the mask for gspo."""
    rewards = [float(len(set(seq.tokens))) for seq in response.sequences]  # any reward with some spread
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, reward in zip(response.sequences, rewards, strict=True):
        advantage = reward - mean or 0.5
        ob_len = len(prompt) - 1
        model_input = types.ModelInput.from_ints(prompt).append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
        assert seq.logprobs is not None
        inputs = {
            "target_tokens": TensorData.from_torch(torch.tensor([0] * ob_len + seq.tokens)),
            "logprobs": TensorData.from_torch(torch.tensor([0.0] * ob_len + seq.logprobs)),
            "advantages": TensorData.from_torch(torch.tensor([0.0] * ob_len + [advantage] * len(seq.tokens))),
        }
        if loss_fn == "gspo":
            mask = [0.0] * ob_len + [1.0] * len(seq.tokens)
            inputs["sequence_ratio_mask"] = TensorData.from_torch(torch.tensor(mask))
        datum = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
        if loss_fn == "stable_reinforce":
            assert seq.sequence_id
            datum = datum.with_provenance(
                model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                             types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
                loss_fn_inputs=[
                    types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
                    types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))],
            )
        data.append(datum)
    return data


@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "gspo", "importance_sampling", "cispo"])
def test_rl_loop_and_math_rl_train_with_each_cookbook_loss(training: tinker.TrainingClient, loss_fn: str) -> None:
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("What is 3 + 4? Answer:")  # math_rl's arithmetic env, one question
    response = sampled_group(training, prompt, record=loss_fn == "stable_reinforce")
    assert len(response.sequences) == 4
    data = rl_datums(prompt, response, loss_fn)

    fwd_bwd = training.forward_backward(data, loss_fn=loss_fn)
    optim = training.optim_step(ADAM)
    result = fwd_bwd.result()
    optim.result()

    assert np.isfinite(result.metrics["loss:sum"])
    assert len(result.loss_fn_outputs) == len(data)
    # Fresh weights sample what they train on: the learner's logprobs of the sampled tokens match the
    # sampler's closely, so nothing leaves the trust region or the clip range.
    if loss_fn in ("stable_reinforce", "gspo"):
        assert result.metrics["clipped_tokens:sum"] == 0
    trained_lp = result.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
    assert response.sequences[0].logprobs is not None
    np.testing.assert_allclose(trained_lp, response.sequences[0].logprobs, atol=2e-2)


def test_stable_reinforce_takes_the_kl_coeff_its_docs_name(training: tinker.TrainingClient) -> None:
    prompt = training.get_tokenizer().encode("2 + 2 =")
    data = rl_datums(prompt, sampled_group(training, prompt, record=True), "stable_reinforce")
    result = training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.05}).result()
    training.optim_step(ADAM).result()
    assert np.isfinite(result.metrics["loss:sum"])
    with pytest.raises(tinker.BadRequestError, match="kl_coeff"):
        training.forward_backward(data, "stable_reinforce", {"kl_coeff": -1.0}).result()


def test_checkpoint_utilities_find_list_and_delete_checkpoints(
    server: LaunchedServer, training: tinker.TrainingClient
) -> None:
    path = training.save_state("to-delete", ttl_seconds=600).result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY)
    run = rest.get_training_run_by_tinker_path(path).result()
    assert run.training_run_id == training.model_id
    assert (run.user_metadata or {}).get("renderer_name") == "qwen3"  # get_renderer_name_from_checkpoint
    listed = rest.list_checkpoints(training.model_id).result()
    assert path in [c.tinker_path for c in listed.checkpoints]
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints]


def test_stable_reinforce_refuses_data_without_recorded_provenance_as_tinker_does(
    server: LaunchedServer, training: tinker.TrainingClient
) -> None:
    prompt = training.get_tokenizer().encode("5 + 5 =")
    recorded = sampled_group(training, prompt, record=True)
    good = rl_datums(prompt, recorded, "stable_reinforce")

    def refused(data: list[types.Datum]) -> str:
        with pytest.raises(tinker.BadRequestError) as error:
            training.forward_backward(data, "stable_reinforce").result()
        return str(error.value)

    bare = rl_datums(prompt, recorded, "importance_sampling")  # no spans at all
    assert "has no provenance" in refused(bare)
    unrecorded = rl_datums(prompt, sampled_group(training, prompt, record=False), "stable_reinforce")
    assert "was not sampled with record_stability_info=True" in refused(unrecorded)
    prompt_advantage = dataclasses.replace(good[0], loss_fn_inputs={
        **good[0].loss_fn_inputs, "advantages": TensorData.from_torch(torch.ones(good[0].model_input.length))})
    assert "come from a prompt but have nonzero advantages" in refused([prompt_advantage])
    # Another tenant cannot train on this tenant's recorded sequences.
    other = tinker.ServiceClient(base_url=server.base_url, api_key=KEY + "-other")
    stranger = other.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="was not sampled with record_stability_info=True"):
        stranger.forward_backward(good, "stable_reinforce").result()
    assert np.isfinite(training.forward_backward(good, "stable_reinforce").result().metrics["loss:sum"])
    training.optim_step(ADAM).result()


def test_weights_download_exports_an_adapter_another_machine_loads_with_peft(
    server: LaunchedServer, training: tinker.TrainingClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`tinker_cookbook.weights.download` of an external export: signed URLs, fetched without a key."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = training.save_weights_external("final", ttl_seconds=600).result().path
    assert "/external_weights/" in path
    urls = tinker.RestClient(base_url=server.base_url, api_key=KEY).get_external_weights_urls(path).result().urls
    for name, url in urls.items():
        response = httpx.get(url, timeout=60)  # no API key: the signature is the credential
        assert response.status_code == 200, response.text
        (tmp_path / name).write_bytes(response.content)
    if server.config["applications"][1]["args"]["backend"] == "mock":
        assert list(urls) == ["adapter.npz"]  # the mock backend's own adapter format, not PEFT
        return

    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(urls)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    assert any("lora_" in name for name, _ in model.named_parameters())
