"""The `vllm` sampler: a vLLM engine over the base model, sampler checkpoints served as LoRA requests.

Each request's adapter directory becomes a `LoRARequest` with a stable integer id: the same checkpoint (path
and file stamp) keeps its id, so vLLM keeps it cached; a checkpoint rewritten in place gets a new id and is
loaded again. Twinkle remembers at most `max_loras` checkpoints and asks the engine to drop the least
recently used one beyond that (vLLM itself keeps at most `engine_args["max_loras"]` on the GPU per step).

Calls to `sample` from several threads are gathered: while the engine runs one `generate`, the requests that
arrive queue up and all go to the engine together in the next one, where vLLM's scheduler batches them
continuously. The request/response contract is the torch sampler's: stop strings and token ids, EOS unless
`stop_at_eos` is off, per-request seeds, the sampled tokens' logprobs and their top-k alternatives, prompt
logprobs (first position None) and top-k prompt logprobs, `num_samples` completions per prompt.

Which logprobs vLLM reports follows `engine_args["logprobs_mode"]`: `raw_logprobs` (vLLM's default) are the
model's own, as the trainer and the torch sampler compute them; `processed_logprobs` are taken after
temperature and top-k/top-p. The `*_logits` modes report logits, not logprobs, and are refused.

vLLM is imported only when the engine is built, so this module loads without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle.errors import BackendFailure, InvalidRequest, NotFound
from twinkle.full_checkpoint import is_full_checkpoint
from twinkle.types import (
    ImageChunk,
    ModelInfo,
    SampledSequence,
    SampleOutput,
    SampleRequest,
    StopReason,
    keep_last_prompt_positions,
    token_ids,
)

EngineFactory = Callable[[str, dict[str, Any]], Any]
# PEFT's file names, as save_weights_for_sampler writes them (not imported: that would load torch and PEFT).
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_MAX_LORA_RANK = 32
VLLM_DEFAULT_MAX_LOGPROBS = 20  # vLLM's default for engine_args.max_logprobs
LOGPROB_MODES = ("raw_logprobs", "processed_logprobs")
_FINISH_REASONS: dict[str, StopReason] = {"stop": "stop", "length": "length"}
INSTALL_HINT = "pip install 'twinkle[vllm]' (vLLM needs a CUDA GPU)"
NEEDS = "sampler_type: vllm needs vllm (pip install 'twinkle[vllm]') and a CUDA GPU"


def vllm_requirements_problem() -> str | None:
    """None when vllm is installed and torch sees a CUDA GPU, else the exact message to show.

    Cheap enough for `check-config`: vllm itself is not imported.
    """
    from twinkle.backends.megatron.requirements import cuda_problem

    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vllm is not installed")
    cuda = cuda_problem()
    if cuda is not None:
        missing.append(cuda)
    return f"{NEEDS}; found: {'; '.join(missing)}." if missing else None


def default_engine(model: str, engine_args: dict[str, Any]) -> Any:
    """vllm.LLM over a local model directory."""
    try:
        from vllm import LLM
    except ImportError as error:
        raise InvalidRequest(
            f"sampler_type: vllm needs the vllm package ({error}).", hint=INSTALL_HINT
        ) from error
    return LLM(model=model, **engine_args)


@dataclass
class _Ticket:
    """One `sample` call waiting for its turn at the engine."""

    requests: list[SampleRequest]
    results: list[SampleOutput] | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.results is not None or self.error is not None


@dataclass
class _Round:
    """The engine inputs of one `generate`: a prompt, SamplingParams and LoRA request per SampleRequest."""

    prompts: list[dict[str, list[int]]] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)
    loras: list[Any] = field(default_factory=list)
    owners: list[tuple[_Ticket, int]] = field(default_factory=list)


class VLLMSampler:
    """Implements `twinkle.backends.base.SamplerBackend` with a vLLM engine."""

    def __init__(
        self,
        model_id: str,
        *,
        engine_args: Mapping[str, Any] | None = None,
        max_loras: int = 4,
        engine_factory: EngineFactory | None = None,
        trust_remote_code: bool | None = None,
    ) -> None:
        if max_loras < 1:
            raise InvalidRequest(f"max_loras must be at least 1, got {max_loras}.")
        args = dict(engine_args or {})
        mode = args.get("logprobs_mode", "raw_logprobs")
        if mode not in LOGPROB_MODES:
            raise InvalidRequest(
                f"engine_args.logprobs_mode {mode!r} reports logits, but samplers return logprobs.",
                hint=f"Use one of: {', '.join(LOGPROB_MODES)}.",
            )
        args.setdefault("enable_lora", True)
        args.setdefault("max_loras", max_loras)
        # vLLM's own default (16) is below Tinker's default LoRA rank (32).
        args.setdefault("max_lora_rank", DEFAULT_MAX_LORA_RANK)
        directory, info, eos_token_id = _describe_model(
            model_id, trust_remote_code, args.get("max_model_len")
        )
        if "max_model_len" not in args:
            args["max_model_len"] = info.max_context_length
        self.info = info
        self.eos_token_id = eos_token_id
        self.max_loras = max_loras
        self.engine_args = args
        self.engine = (engine_factory or default_engine)(str(directory), args)
        self._lora_ids: OrderedDict[str, int] = (
            OrderedDict()
        )  # checkpoint key → id, least recently used first
        self._next_lora_id = 1  # vLLM requires ids > 0
        self._state = threading.Condition()
        self._waiting: list[_Ticket] = []
        self._engine_busy = False

    @property
    def loaded_adapters(self) -> list[int]:
        """LoRA ids Twinkle currently keeps registered with the engine, least recently used first."""
        return list(self._lora_ids.values())

    # Serving

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        """Complete every request; blocks until the engine has served this call (batched with others)."""
        max_logprobs = int(self.engine_args.get("max_logprobs", VLLM_DEFAULT_MAX_LOGPROBS))
        _check_requests(requests, self.info, max_logprobs)
        if not requests:
            return []
        ticket = _Ticket(list(requests))
        with self._state:
            self._waiting.append(ticket)
        while True:
            with self._state:
                while self._engine_busy and not ticket.done:
                    self._state.wait()
                if ticket.done:
                    break
                batch, self._waiting = self._waiting, []
                self._engine_busy = True
            try:
                self._serve(batch)
            finally:
                with self._state:
                    self._engine_busy = False
                    self._state.notify_all()
        if ticket.error is not None:
            raise ticket.error
        assert ticket.results is not None
        return ticket.results

    def _serve(self, tickets: list[_Ticket]) -> None:
        """Run one `generate` for every waiting ticket; each ticket gets its outputs or its own error."""
        round_ = _Round()
        in_round: set[str] = set()
        for ticket in tickets:
            try:
                loras = [self._lora_request(request.adapter_path, in_round) for request in ticket.requests]
            except (NotFound, InvalidRequest) as error:
                ticket.error = error
                continue
            ticket.results = [SampleOutput(sequences=[]) for _ in ticket.requests]
            for index, (request, lora) in enumerate(zip(ticket.requests, loras, strict=True)):
                round_.prompts.append({"prompt_token_ids": token_ids(request.prompt).tolist()})
                round_.params.append(self._sampling_params(request))
                round_.loras.append(lora)
                round_.owners.append((ticket, index))
        if not round_.prompts:
            return
        try:
            outputs = self.engine.generate(
                round_.prompts, round_.params, use_tqdm=False, lora_request=round_.loras
            )
            if len(outputs) != len(round_.prompts):
                raise BackendFailure(
                    f"vLLM returned {len(outputs)} outputs for {len(round_.prompts)} prompts."
                )
            for (ticket, index), output in zip(round_.owners, outputs, strict=True):
                assert ticket.results is not None
                ticket.results[index] = _sample_output(ticket.requests[index], output)
        except Exception as error:  # noqa: BLE001  (each waiting caller re-raises it)
            for ticket, _ in round_.owners:
                ticket.results, ticket.error = None, error

    # Requests to vLLM

    def _sampling_params(self, request: SampleRequest) -> Any:
        from vllm import SamplingParams

        params = request.params
        prompt_k = max(request.topk_prompt_logprobs, 0)
        wants_prompt = request.prompt_logprobs or prompt_k > 0
        return SamplingParams(
            n=request.num_samples,
            # vLLM generates at least one token; a request for none gets one, which is then dropped.
            max_tokens=max(params.max_tokens, 1),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed,
            stop=list(params.stop_strings) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=not params.stop_at_eos,
            logprobs=max(request.topk_sample_logprobs, 0),  # the sampled token's logprob, and the top-k
            prompt_logprobs=prompt_k if wants_prompt else None,
            detokenize=bool(params.stop_strings),  # text is needed only to find stop strings
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        )

    def _lora_request(self, adapter_path: str | None, in_round: set[str]) -> Any:
        """The LoRARequest for a sampler checkpoint, with an id stable while the files are unchanged.

        `in_round` holds the checkpoints this `generate` already uses; they are never evicted for another.
        """
        if adapter_path is None:
            return None
        directory = Path(adapter_path)
        if is_full_checkpoint(directory):  # a whole model: vLLM serves one per engine, not as a LoRA request
            raise InvalidRequest(
                f"Sampler weights {directory.name} are a full-parameter checkpoint, which a vLLM sampler pool "
                "cannot load beside its model.",
                hint="Serve full checkpoints with the torch sampler, or start a vLLM pool on that directory as "
                "its model_id.",
            )
        from vllm.lora.request import LoRARequest

        weights, config = directory / ADAPTER_WEIGHTS, directory / ADAPTER_CONFIG
        if not (weights.is_file() and config.is_file()):
            raise NotFound(
                f"Sampler weights {directory.name} were not found.",
                hint="Save them with save_weights_for_sampler first, or check the checkpoint path.",
            )
        if not self.engine_args.get("enable_lora"):
            raise InvalidRequest(
                "This sampler pool serves the base model only (engine_args.enable_lora is false).",
                hint="Set enable_lora: true in the sampler's engine_args to sample from trained weights.",
            )
        rank = int(json.loads(config.read_text()).get("r", 0))
        max_rank = int(self.engine_args["max_lora_rank"])
        if rank > max_rank:
            raise InvalidRequest(
                f"Sampler weights {directory.name} have LoRA rank {rank}, "
                f"over this pool's max_lora_rank {max_rank}.",
                hint="Raise engine_args.max_lora_rank (vLLM accepts 8, 16, 32, 64, 128, 256, 320, 512).",
            )
        stamp = weights.stat()
        key = f"{directory.resolve()}|{stamp.st_mtime_ns}|{stamp.st_size}"
        if key in self._lora_ids:
            self._lora_ids.move_to_end(key)
        else:
            self._evict_for_one_more(keep=in_round)
            self._lora_ids[key] = self._next_lora_id
            self._next_lora_id += 1
        in_round.add(key)
        name = "twinkle_" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return LoRARequest(name, self._lora_ids[key], str(directory.resolve()))

    def _evict_for_one_more(self, *, keep: set[str]) -> None:
        """Drop least recently used checkpoints from the engine until one more fits (those in `keep` stay)."""
        for key in list(self._lora_ids):
            if len(self._lora_ids) < self.max_loras:
                return
            if key not in keep:
                self.engine.llm_engine.remove_lora(self._lora_ids.pop(key))


# Responses from vLLM


def _sample_output(request: SampleRequest, output: Any) -> SampleOutput:
    """A SampleOutput from a vLLM RequestOutput."""
    result = SampleOutput(sequences=[_sequence(request, completion) for completion in output.outputs])
    if len(result.sequences) != request.num_samples:
        raise BackendFailure(
            f"vLLM returned {len(result.sequences)} completions, {request.num_samples} were asked."
        )
    prompt = token_ids(request.prompt).tolist()
    if request.prompt_logprobs or request.topk_prompt_logprobs > 0:
        positions = list(output.prompt_logprobs or [])
        if len(positions) != len(prompt):
            raise BackendFailure(
                f"vLLM returned {len(positions)} prompt logprobs for a {len(prompt)}-token prompt."
            )
        if request.prompt_logprobs:
            result.prompt_logprobs = [
                None,
                *(
                    float(entry[token].logprob)
                    for entry, token in zip(positions[1:], prompt[1:], strict=True)
                ),
            ]
        if request.topk_prompt_logprobs > 0:
            result.topk_prompt_logprobs = [
                [],
                *(_top_k(entry, request.topk_prompt_logprobs) for entry in positions[1:]),
            ]
    return keep_last_prompt_positions(result, request.prompt_logprobs_last_n)


def _sequence(request: SampleRequest, completion: Any) -> SampledSequence:
    tokens = [int(token) for token in completion.token_ids]
    if request.params.max_tokens == 0:
        return SampledSequence([], [], "length")
    logprobs = completion.logprobs
    if logprobs is None or len(logprobs) != len(tokens):
        raise BackendFailure("vLLM returned no logprob for some sampled tokens; was logprobs=0 dropped?")
    values = [float(entry[token].logprob) for entry, token in zip(logprobs, tokens, strict=True)]
    reason = _FINISH_REASONS.get(str(completion.finish_reason))
    if reason is None:
        raise BackendFailure(f"vLLM ended a completion with finish_reason {completion.finish_reason!r}.")
    k = request.topk_sample_logprobs
    return SampledSequence(tokens, values, reason, [_top_k(entry, k) for entry in logprobs] if k > 0 else None)


def _top_k(entry: Mapping[int, Any], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens at one position, most likely first.

    vLLM's dictionary also holds the prompt's (or sampled) token, whatever its rank; ranks count from 1.
    """
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank, -item[1].logprob))
    return [(int(token), float(logprob.logprob)) for token, logprob in ranked if logprob.rank <= k][:k]


# The model


def _describe_model(
    model_id: str, trust_remote_code: bool | None, max_model_len: int | None
) -> tuple[Path, ModelInfo, int | None]:
    """The local checkpoint directory, the ModelInfo the API shows, and the EOS token id."""
    from transformers import AutoConfig, AutoTokenizer

    from twinkle.backends.hf.loading import model_directory
    from twinkle.backends.hf.loading import trust_remote_code as remote_code_allowed

    directory = model_directory(model_id)
    remote = remote_code_allowed(trust_remote_code)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=remote)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=remote)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = max_model_len or getattr(text_config, "max_position_embeddings", None) or 4096
    name = model_id.split("://", 1)[1] if "://" in model_id else model_id
    info = ModelInfo(
        model_name=name,
        vocab_size=int(text_config.vocab_size),
        max_context_length=int(context),
        tokenizer_id=name,
        arch=(getattr(config, "architectures", None) or [config.model_type])[0],
        eos_token_id=tokenizer.eos_token_id,
    )
    return directory, info, tokenizer.eos_token_id


def _check_requests(requests: Sequence[SampleRequest], info: ModelInfo, max_logprobs: int) -> None:
    """Refuse what the engine would reject, with every problem named (vLLM's own errors are terser)."""
    problems = []
    for index, request in enumerate(requests):
        params = request.params
        prompt = token_ids(request.prompt)
        if any(isinstance(chunk, ImageChunk) for chunk in request.prompt):
            problems.append(f"request {index} holds images but this sampler reads text only")
        if prompt.size == 0:
            problems.append(f"request {index} has an empty prompt")
        elif prompt.min() < 0 or prompt.max() >= info.vocab_size:
            problems.append(f"request {index} has token ids outside [0, {info.vocab_size})")
        if prompt.size >= info.max_context_length:
            problems.append(
                f"request {index} has a {prompt.size}-token prompt, which leaves no room under max_model_len "
                f"{info.max_context_length}"
            )
        if request.num_samples < 1:
            problems.append(f"request {index} asks for {request.num_samples} samples (at least 1)")
        if params.max_tokens < 0:
            problems.append(f"request {index} has max_tokens {params.max_tokens} (at least 0)")
        if not params.temperature >= 0:
            problems.append(f"request {index} has temperature {params.temperature} (0 for greedy, or more)")
        if not 0 < params.top_p <= 1:
            problems.append(f"request {index} has top_p {params.top_p} (in (0, 1])")
        for name, what in (("topk_prompt_logprobs", "prompt"), ("topk_sample_logprobs", "sampled")):
            k = getattr(request, name)
            if k > max_logprobs >= 0:
                problems.append(
                    f"request {index} asks for {k} top {what} logprobs, "
                    f"over this pool's engine_args.max_logprobs {max_logprobs}"
                )
            if k < 0:
                problems.append(f"request {index} has {name} {k} (at least 0)")
    if problems:
        raise InvalidRequest(
            "Invalid sample request: " + "; ".join(problems[:10]) + ".", problems=len(problems)
        )
