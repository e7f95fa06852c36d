"""TwinkleClient: the connection to one Twinkle server, its session, and the server's runs and checkpoints.

    client = init_twinkle_client(base_url='http://127.0.0.1:8000', api_key='your-api-key')
    for item in client.get_server_capabilities().supported_models:
        print(item.model_name)
    latest = client.get_latest_checkpoint_path(run_id)

`init_twinkle_client` also makes the client the *current* one, which `MultiLoraTransformersModel`,
`Sampler` and the remote `Dataset` use unless they are given a `client=` explicitly. That is the only
module-level state; everything else lives on the client object. Close it with `close()` or a `with`
block; otherwise it closes itself when the interpreter exits.
"""

from __future__ import annotations

import atexit
import os
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Literal, TypeVar
from urllib.parse import quote

import httpx

from twinkle_client.errors import InvalidArgument, NotFoundError, TwinkleClientError
from twinkle_client.exports import checkpoint_parts, download_files
from twinkle_client.futures import FuturePoller, TwinkleFuture
from twinkle_client.session import Session
from twinkle_client.transport import NO_RETRIES, RetryPolicy, Transport
from twinkle_client.types import (
    CapacityInfo,
    Checkpoint,
    ImportedAdapter,
    MergedExport,
    MergedUrls,
    ServerCapabilities,
    SupportedModel,
    TrainingRun,
    WeightsInfo,
)

T = TypeVar("T")
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
LONG_POLL_MARGIN = 45.0  # the server holds a poll ~30 s; a poll's read timeout must outlast that
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
UPLOAD_CHUNK = 1 << 20


class TwinkleClient:
    """A session on a Twinkle server plus the management calls (runs, checkpoints, capabilities).

    `timeout` bounds each HTTP request (polls for results may wait longer: results arrive when ready);
    `retry` sets how connection failures and 429/503 answers are retried; `transport` replaces the HTTP
    transport (tests pass an httpx.MockTransport).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        heartbeat_interval: float = 10.0,
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        poll_workers: int = 16,
    ) -> None:
        if not api_key:
            raise InvalidArgument("An API key is required: pass api_key=... or set TWINKLE_SERVER_TOKEN.")
        self._transport = Transport(
            base_url,
            api_key,
            timeout=timeout,
            retry=retry,
            transport=transport,
            max_connections=poll_workers + 8,
        )
        self._poller = FuturePoller(
            self._transport, workers=poll_workers, poll_timeout=max(timeout, LONG_POLL_MARGIN)
        )
        self._served: list[SupportedModel] | None = None
        self._close_lock = threading.Lock()
        self._closed = False
        try:
            self._session = Session(self._transport, heartbeat_interval=heartbeat_interval)
        except BaseException:
            self._transport.close()
            raise
        atexit.register(self.close)

    # Connection and session.

    @property
    def base_url(self) -> str:
        """The `/api/v1` URL every request goes to."""
        return self._transport.api_url

    @property
    def session_id(self) -> str:
        return self._session.session_id

    @property
    def session(self) -> Session:
        return self._session

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the heartbeat, finish the session on the server and release connections (idempotent)."""
        global _current
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._session.close()
        self._poller.close()
        self._transport.close()
        if _current is self:
            _current = None

    def __enter__(self) -> TwinkleClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return f"TwinkleClient({self.base_url!r}, session={self.session_id!r}{state})"

    # Server.

    def health_check(self) -> bool:
        """Whether the server answers and its queue is reachable (never raises for a down server)."""
        try:
            reply = self._transport.request("GET", "/healthz", timeout=10.0, retry=NO_RETRIES)
        except TwinkleClientError:
            return False
        return isinstance(reply, dict) and reply.get("status") == "ok"

    def get_server_capabilities(self) -> ServerCapabilities:
        """The base models this server serves (`.supported_models[].model_name`)."""
        capabilities = ServerCapabilities.model_validate(
            self._transport.request("GET", "/get_server_capabilities")
        )
        self._served = capabilities.supported_models
        return capabilities

    def get_capacity_info(self) -> CapacityInfo:
        """Free and used LoRA slots per base model."""
        return CapacityInfo.model_validate(self._transport.request("GET", "/twinkle/capacity_info"))

    def served_model(self, model_id: str, purpose: Literal["train", "sample"] = "train") -> SupportedModel:
        """The served base model that `model_id` names: `ms://Org/Name`, `hf://Org/Name`, `Org/Name`, the
        served name, or a local model directory (matched by its basename)."""
        served = self._served if self._served is not None else self.get_server_capabilities().supported_models
        name = _plain_model_name(model_id)
        match = next((m for m in served if m.model_name == name), None)
        if match is None:
            tail = name.rstrip("/").rsplit("/", 1)[-1]
            candidates = [m for m in served if m.model_name.rsplit("/", 1)[-1] == tail]
            match = candidates[0] if len(candidates) == 1 else None
        if match is None:
            names = ", ".join(m.model_name for m in served) or "(none)"
            raise InvalidArgument(
                f"The server at {self.base_url} does not serve {model_id!r}. Served models: {names}."
            )
        if purpose == "train" and not match.trainable:
            raise InvalidArgument(
                f"{match.model_name} is served for sampling only on this server; it cannot train."
            )
        if purpose == "sample" and not match.sampleable:
            raise InvalidArgument(
                f"{match.model_name} has no sampler on this server; ask the operator to add one."
            )
        return match

    # Training runs and checkpoints.

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> list[TrainingRun]:
        """This API key's training runs, `limit` at a time starting at `offset`."""
        reply = self._transport.request("GET", "/training_runs", params={"limit": limit, "offset": offset})
        return [TrainingRun.model_validate(run) for run in reply.get("training_runs", [])]

    def get_training_run(self, run_id: str) -> TrainingRun:
        return TrainingRun.model_validate(
            self._transport.request("GET", f"/training_runs/{_segment(run_id)}")
        )

    def list_checkpoints(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints, oldest first."""
        reply = self._transport.request("GET", f"/training_runs/{_segment(run_id)}/checkpoints")
        return [Checkpoint.model_validate(c) for c in reply.get("checkpoints", [])]

    def get_checkpoint_path(self, run_id: str, checkpoint_id: str) -> str:
        """The `twinkle://` path of a checkpoint, by id (`weights/<name>`) or by name alone."""
        checkpoints = self.list_checkpoints(run_id)
        for checkpoint in checkpoints:
            if checkpoint_id in (checkpoint.checkpoint_id, checkpoint.checkpoint_id.partition("/")[2]):
                return checkpoint.twinkle_path
        known = ", ".join(c.checkpoint_id for c in checkpoints) or "(none)"
        raise NotFoundError(
            404, f"Run {run_id} has no checkpoint {checkpoint_id!r}. Its checkpoints: {known}."
        )

    def get_latest_checkpoint_path(
        self, run_id: str, checkpoint_type: Literal["training", "sampler"] = "training"
    ) -> str | None:
        """The `twinkle://` path of the run's newest checkpoint of that type; None if it has none."""
        matching = [c for c in self.list_checkpoints(run_id) if c.checkpoint_type == checkpoint_type]
        return max(matching, key=lambda c: c.time).twinkle_path if matching else None

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        self._transport.request(
            "DELETE", f"/training_runs/{_segment(run_id)}/checkpoints/{quote(checkpoint_id, safe='/')}"
        )

    def get_weights_info(self, path: str) -> WeightsInfo:
        """Base model and LoRA rank of a checkpoint given by its `twinkle://` or `tinker://` path."""
        return WeightsInfo.model_validate(
            self._transport.request("POST", "/weights_info", json={"tinker_path": path}, idempotent=True)
        )

    def import_adapter(
        self,
        adapter: str | os.PathLike[str],
        *,
        base_model: str | None = None,
        name: str | None = None,
        ttl_seconds: int | None = None,
        timeout: float = 600.0,
    ) -> ImportedAdapter:
        """Upload a PEFT LoRA adapter; it becomes checkpoints this API key owns.

        `adapter` is the directory `PeftModel.save_pretrained` wrote (its adapter_config.json and
        adapter_model.safetensors are sent, nothing else) or a .tar / .tar.gz of one. `base_model` names the
        served model it was trained on (default: the config's base_model_name_or_path), `name` the checkpoint.
        Train on it with `model.add_adapter_to_model(name, imported.lora_config)` and
        `model.resume_from_checkpoint(imported.twinkle_path, resume_only_model=True)`; sample it with
        `adapter_path=imported.twinkle_sampler_path`. The server refuses a wrong base model, foreign shapes,
        pickles and oversized uploads with a message saying which.
        """
        params = {
            key: value
            for key, value in (("base_model", base_model), ("name", name), ("ttl_seconds", ttl_seconds))
            if value is not None
        }
        with _adapter_archive(Path(adapter)) as archive:
            size = archive.seek(0, os.SEEK_END)

            def body() -> Iterator[bytes]:
                archive.seek(0)
                while chunk := archive.read(UPLOAD_CHUNK):
                    yield chunk

            reply = self._transport.request(
                "POST",
                "/import_adapter",
                params=params,
                content=body,
                headers={"Content-Type": "application/x-tar", "Content-Length": str(size)},
                timeout=timeout,
            )
        return ImportedAdapter.model_validate(reply)

    # Merged exports (twinkle_client.exports).

    def export_merged(self, path: str) -> MergedExport:
        """Have the server merge the checkpoint's LoRA into the base weights and check the result against its
        own logprobs; waits for it. Once per checkpoint: asking again answers the same export. A merged model
        that failed its check raises the server's error (code export_verification_failed) naming the difference.
        """
        return self.submit_export_merged(path).result()

    def submit_export_merged(self, path: str) -> TwinkleFuture[MergedExport]:
        return self.submit("/export_merged", {"path": path}, MergedExport.model_validate, label="export_merged")

    def get_merged_urls(self, path: str) -> MergedUrls:
        """Signed URLs of the verified merged export's files (config.json, safetensors shards, tokenizer)."""
        run_id, checkpoint_id = checkpoint_parts(path)
        return MergedUrls.model_validate(self._transport.request(
            "GET", f"/training_runs/{_segment(run_id)}/checkpoints/{quote(checkpoint_id, safe='/')}/merged_urls"))

    def download_merged(self, path: str, directory: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Merge (if not done yet) and download the checkpoint as a Hugging Face model directory that
        `AutoModelForCausalLM.from_pretrained(directory)` loads; returns the directory."""
        self.export_merged(path)
        return download_files(self.get_merged_urls(path).urls, directory, overwrite=overwrite)

    # Requests that answer with a future (used by the model, sampler and dataset classes).

    def submit(
        self,
        path: str,
        body: dict[str, Any],
        parse: Callable[[dict[str, Any]], T],
        *,
        label: str | None = None,
        show_queue: bool = True,
    ) -> TwinkleFuture[T]:
        """POST `body` to a route that answers `{"request_id"}` and return the future of its result."""
        return self._poller.track(self._start(path, body), parse, label or _label(path), show_queue)

    def call(self, path: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], T]) -> T:
        """Like submit(...).result(), polling on the calling thread (for use inside run_in_background)."""
        return self._poller.wait(self._start(path, body), parse, _label(path))

    def run_in_background(self, work: Callable[[], T], label: str) -> TwinkleFuture[T]:
        """A future for `work()` (calls that chain several requests), run on the client's poller threads."""
        return self._poller.run(work, label)

    def _start(self, path: str, body: dict[str, Any]) -> str:
        reply = self._transport.request("POST", path, json=body)
        request_id = reply.get("request_id") if isinstance(reply, dict) else None
        if not isinstance(request_id, str):
            raise TwinkleClientError(f"POST {path} answered without a request_id: {str(reply)[:200]}")
        return request_id


def init_twinkle_client(
    base_url: str | None = None,
    api_key: str | None = None,
    *,
    heartbeat_interval: float = 10.0,
    timeout: float = 60.0,
    **options: Any,
) -> TwinkleClient:
    """Connect to a Twinkle server, start a session, and make the client the current one.

    `base_url` defaults to $TWINKLE_SERVER_URL, then http://127.0.0.1:8000 (with or without `/api/v1`);
    `api_key` defaults to $TWINKLE_SERVER_TOKEN. `options` go to TwinkleClient (retry, transport,
    poll_workers).
    """
    global _current
    url = base_url or os.environ.get("TWINKLE_SERVER_URL") or DEFAULT_BASE_URL
    key = api_key or os.environ.get("TWINKLE_SERVER_TOKEN") or ""
    client = TwinkleClient(url, key, heartbeat_interval=heartbeat_interval, timeout=timeout, **options)
    _current = client
    return client


def current_client() -> TwinkleClient:
    """The client the last init_twinkle_client() call made (if it is still open)."""
    if _current is None or _current.closed:
        raise InvalidArgument(
            "No Twinkle client is connected. Call init_twinkle_client(base_url=..., api_key=...) first, "
            "or pass client=... explicitly."
        )
    return _current


_current: TwinkleClient | None = None


def _plain_model_name(model_id: str) -> str:
    for scheme in ("ms://", "hf://"):
        if model_id.startswith(scheme):
            return model_id[len(scheme) :]
    path = os.path.expanduser(model_id)
    if os.path.isdir(path):
        return os.path.basename(os.path.normpath(path))
    return model_id


def _adapter_archive(adapter: Path) -> IO[bytes]:
    """An open file holding the upload: a tar of the directory's two adapter files, or the archive itself."""
    if adapter.is_dir():
        archive = tempfile.TemporaryFile()  # noqa: SIM115 - the caller's `with` closes it
        with tarfile.open(fileobj=archive, mode="w") as tar:
            for file_name in ADAPTER_FILES:
                if (adapter / file_name).is_file():
                    tar.add(adapter / file_name, arcname=file_name)
        return archive
    if adapter.is_file():
        return adapter.open("rb")
    raise InvalidArgument(
        f"{str(adapter)!r} is neither an adapter directory nor an archive. Pass the directory "
        "PeftModel.save_pretrained wrote (adapter_config.json, adapter_model.safetensors) or a .tar of it."
    )


def _label(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _segment(value: str) -> str:
    if not value or "/" in value:
        raise InvalidArgument(f"Not a run id: {value!r}. Use training_run_id from list_training_runs().")
    return quote(value, safe="")


__all__ = ["TwinkleClient", "current_client", "init_twinkle_client"]
