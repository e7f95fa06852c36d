"""Sampler: completions from a served base model or a saved adapter, generated on the server's sampler pool.

    sampler = Sampler('ms://Qwen/Qwen3.5-4B')
    sampler.set_template('Qwen3_5Template', model_id=local_model_dir)  # to sample Trajectories, decode text
    result = sampler.sample(Trajectory(messages=[Message('user', '你是谁？')]),
                            sampling_params={'max_tokens': 64, 'temperature': 0.7},
                            adapter_path=model.save('for-sampling', is_sampler=True), num_samples=4)
    for sequence in result.sequences:
        print(sequence.text, sequence.stop_reason)

A prompt is a list of token ids, an InputFeature (its input_ids) or a Trajectory (encoded locally with the
template, ending in an open assistant turn). A list of prompts is sampled in parallel and gives a list of
results. `vLLMSampler` is the same class under the reference client's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel

from twinkle_client.client import TwinkleClient, current_client
from twinkle_client.errors import InvalidArgument
from twinkle_client.futures import TwinkleFuture
from twinkle_client.types import SampleResult

SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def sampling_params_body(params: Any) -> dict[str, Any]:
    """The server's sampling_params from a dict, a pydantic model (Tinker's SamplingParams) or a dataclass."""
    if params is None:
        return {}
    if isinstance(params, Mapping):
        options = dict(params)
    elif isinstance(params, BaseModel):
        options = params.model_dump(exclude_none=True)
    elif dataclasses.is_dataclass(params) and not isinstance(params, type):
        options = dataclasses.asdict(params)
    else:
        raise InvalidArgument(
            f"sampling_params must be a dict such as {{'max_tokens': 64, 'temperature': 0.7}}, "
            f"got {type(params).__name__}."
        )
    unknown = sorted(key for key, value in options.items() if key not in SAMPLING_KEYS and value is not None)
    if unknown:
        raise InvalidArgument(f"Unknown sampling params {unknown}. Known: {', '.join(SAMPLING_KEYS)}.")
    return {key: value for key, value in options.items() if value is not None}


class Sampler:
    """Samples from the base model `model_id` names, or from an adapter checkpoint given per call."""

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None) -> None:
        self.client = client or current_client()
        self.model_id = model_id
        self.base_model = self.client.served_model(model_id, "sample").model_name
        self.template: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_model!r})"

    def set_template(self, template: Any, **init_args: Any) -> Any:
        """Use a twinkle Template (or a registered name, built with `init_args`; model_id defaults to this
        sampler's) to encode Trajectory prompts and decode sampled tokens. It needs the tokenizer locally."""
        if isinstance(template, str):
            from twinkle.template import get_template  # loads transformers: only when a template is wanted

            init_args.setdefault("model_id", self.model_id)
            self.template = get_template(template, **init_args)
        elif hasattr(template, "encode") and hasattr(template, "decode"):
            if init_args:
                raise InvalidArgument(
                    "init_args only go with a template name; configure the Template itself."
                )
            self.template = template
        else:
            raise InvalidArgument(
                f"Not a template: {type(template).__name__}. Pass a name such as "
                "'Qwen3_5Template' or a twinkle.template.Template."
            )
        return self.template

    def sample(
        self,
        inputs: Any,
        sampling_params: Any = None,
        adapter_path: str | None = None,
        num_samples: int = 1,
        logprobs: bool | int = True,
        prompt_logprobs: bool = False,
    ) -> SampleResult | list[SampleResult]:
        """`num_samples` completions of one prompt (a SampleResult), or of each of a list of prompts (a list).

        `adapter_path` is a `twinkle://` checkpoint path (from model.save); None samples the base model.
        `logprobs` keeps each sampled token's log-probability; `prompt_logprobs` also scores the prompt.
        """
        if _is_batch(inputs):
            futures = [
                self.submit_sample(
                    prompt, sampling_params, adapter_path, num_samples, logprobs, prompt_logprobs
                )
                for prompt in inputs
            ]
            return [future.result() for future in futures]
        return self.submit_sample(
            inputs, sampling_params, adapter_path, num_samples, logprobs, prompt_logprobs
        ).result()

    def submit_sample(
        self,
        prompt: Any,
        sampling_params: Any = None,
        adapter_path: str | None = None,
        num_samples: int = 1,
        logprobs: bool | int = True,
        prompt_logprobs: bool = False,
    ) -> TwinkleFuture[SampleResult]:
        """Like sample() for one prompt, returning the future."""
        if not isinstance(num_samples, int) or num_samples < 1:
            raise InvalidArgument(f"num_samples must be an int >= 1, got {num_samples!r}.")
        body: dict[str, Any] = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": self._prompt_tokens(prompt)}]},
            "sampling_params": sampling_params_body(sampling_params),
            "num_samples": num_samples,
            "prompt_logprobs": bool(prompt_logprobs),
        }
        if adapter_path:
            body["model_path"] = adapter_path
        else:
            body["base_model"] = self.base_model
        template = self.template

        def parse(reply: dict[str, Any]) -> SampleResult:
            result = SampleResult.model_validate(reply)
            for sequence in result.sequences:
                if not logprobs:
                    sequence.logprobs = None
                if template is not None:
                    sequence.text = template.decode(sequence.tokens)
            return result

        return self.client.submit("/asample", body, parse, label="sample")

    def _prompt_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, BaseModel) or (isinstance(prompt, Mapping) and "messages" in prompt):
            if self.template is None:
                raise InvalidArgument(
                    "Sampling a Trajectory needs a template to encode it: call "
                    "sampler.set_template('Qwen3_5Template', ...) first, or pass token ids."
                )
            prompt = self.template.encode(prompt, add_generation_prompt=True)
        if isinstance(prompt, Mapping):
            if "input_ids" not in prompt:
                raise InvalidArgument(
                    f"A prompt dict needs input_ids or messages, got keys {sorted(prompt)}."
                )
            prompt = prompt["input_ids"]
        if isinstance(prompt, str):
            raise InvalidArgument(
                "Prompts are token ids, InputFeatures or Trajectories, not text. Wrap the text "
                "in a Trajectory and set a template."
            )
        if hasattr(prompt, "detach"):  # a torch tensor
            prompt = prompt.detach().cpu().tolist()
        tokens = np.asarray(prompt)
        if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidArgument(
                f"A prompt must be a non-empty list of token ids, got shape {tokens.shape} of {tokens.dtype}."
            )
        return [int(token) for token in tokens]


vLLMSampler = Sampler


def _is_batch(inputs: Any) -> bool:
    if isinstance(inputs, np.ndarray):
        return inputs.ndim == 2
    if isinstance(inputs, Sequence) and not isinstance(inputs, str | bytes) and len(inputs) > 0:
        return not isinstance(inputs[0], int | np.integer)
    return False
