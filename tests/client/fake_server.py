"""An in-process fake of the Twinkle HTTP contract (the routes in api/routes/) behind httpx.MockTransport.

It keeps just enough state to answer like the real server: sessions and heartbeats, runs with a training
configuration, gradient accumulation, metrics since the last call, checkpoints with progress, futures that
can answer try_again a few times, and injected failures (HTTP errors with Retry-After, dropped connections).
Every request is recorded so tests can check what the client sent.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

API = "/api/v1"
REGISTRIES = {
    "loss": ["CrossEntropyLoss", "DPOLoss", "GRPOLoss"],
    "optimizer": ["Adam", "AdamW", "default"],
    "lr_scheduler": ["ConstantLR", "CosineAnnealingLR", "CosineWarmupLR", "LinearLR", "default"],
    "processor": ["InputProcessor"],
    "template": ["Qwen3_5Template", "Template"],
}


class UserFailure(Exception):
    """Makes the fake fail a future with category "user"."""


@dataclass
class Recorded:
    method: str
    path: str
    body: Any
    headers: dict[str, str]


@dataclass
class FakeFuture:
    result: dict[str, Any] | None
    error: str | None = None
    try_again: int = 0
    op: str = ""


@dataclass
class FakeRun:
    run_id: str
    base_model: str
    owner: str
    lora: dict[str, Any]
    user_metadata: dict[str, Any]
    config: dict[str, Any] = field(default_factory=lambda: {"gradient_accumulation_steps": 1})
    calls_since_step: int = 0
    cur_step: int = 0
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)
    received_inputs: list[list[dict[str, Any]]] = field(default_factory=list)
    active: bool = True


@dataclass
class Injected:
    method: str
    path: str
    times: int
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)
    drop_connection: bool = False


class FakeTwinkleServer:
    """Answers /api/v1 requests for the base models in `models`; `api_key` is the only valid key."""

    def __init__(
        self,
        models: tuple[str, ...] = ("Qwen/Qwen3.5-4B",),
        *,
        api_key: str = "test-key",
        max_loras: int = 4,
        sampleable: bool = True,
    ) -> None:
        self.models = models
        self.api_key = api_key
        self.max_loras = max_loras
        self.sampleable = sampleable
        self.requests: list[Recorded] = []
        self.sessions: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, FakeRun] = {}
        self.futures: dict[str, FakeFuture] = {}
        self.try_again_per_future = 0
        self.try_again_reason = "queued on model.tiny.0, 3 ahead"
        self.events: list[tuple[str, str]] = []
        self._injected: list[Injected] = []
        self._ids = itertools.count(1)
        self._clock = datetime(2025, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()
        self._routes: list[tuple[str, re.Pattern[str], Callable[..., Any]]] = [
            ("GET", re.compile(r"/healthz"), self._healthz),
            ("POST", re.compile(r"/create_session"), self._create_session),
            ("POST", re.compile(r"/session_heartbeat"), self._heartbeat),
            ("POST", re.compile(r"/sessions/(?P<session_id>[^/]+)/finish"), self._finish),
            ("GET", re.compile(r"/get_server_capabilities"), self._capabilities),
            ("GET", re.compile(r"/training_runs"), self._list_runs),
            ("GET", re.compile(r"/training_runs/(?P<run_id>[^/]+)"), self._get_run),
            ("GET", re.compile(r"/training_runs/(?P<run_id>[^/]+)/checkpoints"), self._list_checkpoints),
            ("DELETE", re.compile(r"/training_runs/(?P<run_id>[^/]+)/checkpoints/(?P<cid>.+)"), self._delete),
            ("POST", re.compile(r"/weights_info"), self._weights_info),
            ("POST", re.compile(r"/retrieve_future"), self._retrieve),
            ("GET", re.compile(r"/twinkle/capacity_info"), self._capacity),
        ]
        self._ops: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
            "/create_model": self._create_model,
            "/unload_model": self._unload_model,
            "/asample": self._sample,
            "/twinkle/configure": self._configure,
            "/twinkle/forward_backward": self._forward_backward,
            "/twinkle/forward_only": self._forward_only,
            "/twinkle/clip_grad_and_step": self._clip_grad_and_step,
            "/twinkle/calculate_metric": self._calculate_metric,
            "/twinkle/get_train_configs": self._get_train_configs,
            "/twinkle/save": self._save,
            "/twinkle/resume_from_checkpoint": self._resume,
            "/twinkle/upload_to_hub": self._upload,
            "/twinkle/encode": self._encode,
        }

    # Test controls.

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def inject(
        self,
        method: str,
        path: str,
        *,
        times: int = 1,
        status: int | None = None,
        retry_after: str | None = None,
        error: str = "injected failure",
        drop_connection: bool = False,
    ) -> None:
        """Answer the next `times` requests to `path` with `status` (or drop the connection)."""
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        body = {
            "error": error,
            "category": "server" if (status or 500) >= 500 else "user",
            "code": f"http_{status}",
            "request_id": "rid-injected",
        }
        self._injected.append(Injected(method, API + path, times, status, headers, body, drop_connection))

    def sent(self, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.path == API + path]

    def run(self, run_id: str | None = None) -> FakeRun:
        return self.runs[run_id] if run_id else next(iter(self.runs.values()))

    # Dispatch.

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path = request.url.path
        with self._lock:
            self.requests.append(Recorded(request.method, path, body, dict(request.headers)))
            for injected in self._injected:
                if injected.times > 0 and injected.method == request.method and injected.path == path:
                    injected.times -= 1
                    if injected.drop_connection:
                        raise httpx.ConnectError("connection refused (injected)", request=request)
                    return httpx.Response(
                        injected.status or 500, json=injected.body, headers=injected.headers
                    )
            if request.headers.get("x-api-key") != self.api_key:
                return _error(401, "The API key is not valid.", "user")
            if not path.startswith(API):
                return _error(404, f"No route {request.method} {path}.", "user")
            route = path[len(API) :]
            if request.method == "POST" and route in self._ops:
                return self._submit(route, body or {})
            for method, pattern, handler in self._routes:
                match = pattern.fullmatch(route)
                if method == request.method and match:
                    try:
                        return httpx.Response(
                            200, json=handler(body, dict(request.url.params), **match.groupdict())
                        )
                    except LookupError as error:
                        return _error(404, str(error), "user")
                    except UserFailure as error:
                        return _error(400, str(error), "user")
            return _error(404, f"No route {request.method} {path}.", "user")

    def _submit(self, route: str, body: dict[str, Any]) -> httpx.Response:
        request_id = f"req-{next(self._ids)}"
        try:
            future = FakeFuture(self._ops[route](request_id, body), op=route)
        except UserFailure as failure:
            future = FakeFuture(None, error=str(failure), op=route)
        future.try_again = self.try_again_per_future
        self.futures[request_id] = future
        self.events.append(("submit", request_id))
        reply: dict[str, Any] = {"request_id": request_id}
        if "model_id" in body:
            reply["model_id"] = body["model_id"]
        return httpx.Response(200, json=reply)

    def _retrieve(self, body: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
        future = self.futures.get(body["request_id"])
        if future is None:
            raise LookupError(f"Future {body['request_id']} not found.")
        if future.try_again > 0:
            future.try_again -= 1
            return {
                "type": "try_again",
                "request_id": body["request_id"],
                "queue_state": "active",
                "queue_state_reason": self.try_again_reason,
                "status": "queued",
            }
        self.events.append(("retrieved", body["request_id"]))
        if future.error is not None:
            return {"error": future.error, "category": "user", "code": "invalid_request"}
        assert future.result is not None
        return future.result

    # Sessions and server.

    def _healthz(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        return {"status": "ok"}

    def _create_session(self, body: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
        session_id = f"session-{next(self._ids)}"
        self.sessions[session_id] = {
            "heartbeats": 0,
            "finished": None,
            "sdk_version": body.get("sdk_version"),
        }
        return {"type": "create_session", "session_id": session_id}

    def _heartbeat(self, body: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
        session = self.sessions.get(body["session_id"])
        if session is None:
            raise LookupError(f"Session {body['session_id']} not found.")
        session["heartbeats"] += 1
        return {"type": "session_heartbeat"}

    def _finish(self, body: dict[str, Any], params: dict[str, str], session_id: str) -> dict[str, Any]:
        self.sessions[session_id]["finished"] = body["reason"]["type"]
        return {}

    def _capabilities(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": name,
                    "max_context_length": 2048,
                    "trainable": True,
                    "sampleable": self.sampleable,
                }
                for name in self.models
            ]
        }

    def _capacity(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        used = sum(1 for run in self.runs.values() if run.active)
        return {
            "models": [
                {
                    "model_name": name,
                    "max_loras": self.max_loras,
                    "used_loras": used,
                    "free_loras": self.max_loras - used,
                }
                for name in self.models
            ]
        }

    # Runs and checkpoints.

    def _run_json(self, run: FakeRun) -> dict[str, Any]:
        checkpoints = sorted(run.checkpoints.values(), key=lambda c: c["time"])
        return {
            "training_run_id": run.run_id,
            "base_model": run.base_model,
            "model_owner": run.owner,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": run.lora.get("rank"),
            "last_request_time": self._now().isoformat(),
            "last_checkpoint": checkpoints[-1] if checkpoints else None,
            "last_sampler_checkpoint": None,
            "user_metadata": run.user_metadata,
        }

    def _list_runs(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        limit, offset = int(params.get("limit", 20)), int(params.get("offset", 0))
        runs = list(self.runs.values())
        return {
            "training_runs": [self._run_json(r) for r in runs[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    def _get_run(self, body: Any, params: dict[str, str], run_id: str) -> dict[str, Any]:
        return self._run_json(self._find_run(run_id))

    def _list_checkpoints(self, body: Any, params: dict[str, str], run_id: str) -> dict[str, Any]:
        run = self._find_run(run_id)
        return {"checkpoints": sorted(run.checkpoints.values(), key=lambda c: c["time"])}

    def _delete(self, body: Any, params: dict[str, str], run_id: str, cid: str) -> dict[str, Any]:
        run = self._find_run(run_id)
        if cid not in run.checkpoints:
            raise LookupError(f"Checkpoint {cid} not found.")
        del run.checkpoints[cid]
        return {}

    def _weights_info(self, body: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
        run, _ = self._checkpoint(body["tinker_path"])
        return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.lora.get("rank")}

    # Model ops (run synchronously at submit; the future only delays the answer).

    def _create_model(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("session_id") not in self.sessions:
            raise UserFailure(f"Session {body.get('session_id')} not found.")
        if body["base_model"] not in self.models:
            raise UserFailure(f"Base model {body['base_model']!r} is not served here.")
        run_id = f"run-{next(self._ids)}"
        self.runs[run_id] = FakeRun(
            run_id,
            body["base_model"],
            "tenant",
            body.get("lora_config") or {},
            body.get("user_metadata") or {},
        )
        return {"model_id": run_id}

    def _unload_model(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self._model(body).active = False
        return {"model_id": body["model_id"]}

    def _configure(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        run = self._model(body)
        for kind, names in REGISTRIES.items():
            if kind in body and body[kind] not in names:
                raise UserFailure(f"Unknown {kind} {body[kind]!r}. Valid names: {', '.join(names)}.")
        run.config.update({key: value for key, value in body.items() if key != "model_id"})
        return {"train_config": dict(run.config)}

    def _forward_backward(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        run = self._model(body)
        result = self._forward(run, body)
        run.losses.append(result["loss"])
        return {**result, "metrics": {"tokens": self._count_tokens(body["inputs"])}}

    def _forward_only(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._forward(self._model(body), body)

    def _forward(self, run: FakeRun, body: dict[str, Any]) -> dict[str, Any]:
        inputs = body["inputs"]
        for item in inputs:
            if "messages" in item and "template" not in run.config:
                raise UserFailure("Trajectory inputs need a template: call set_template first.")
            if "input_ids" in item and not all(
                isinstance(t, int) for t in item["input_ids"] + item["labels"]
            ):
                raise UserFailure("input_ids and labels must be lists of ints.")
        run.received_inputs.append(inputs)
        run.tokens += self._count_tokens(inputs)
        loss = round(2.0 / (1 + run.cur_step), 6)
        return {
            "loss": loss,
            "logprobs": [[-loss] * max(1, len(item.get("labels", [0])) - 1) for item in inputs],
        }

    def _count_tokens(self, inputs: list[dict[str, Any]]) -> int:
        return sum(sum(1 for label in item.get("labels", []) if label != -100) for item in inputs)

    def _clip_grad_and_step(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        run = self._model(body)
        run.calls_since_step += 1
        stepped = run.calls_since_step >= run.config["gradient_accumulation_steps"]
        if stepped:
            run.calls_since_step = 0
            run.cur_step += 1
        lr = run.config.get("optimizer_kwargs", {}).get("lr", 1e-4)
        return {"stepped": stepped, "cur_step": run.cur_step, "grad_norm": 1.5 if stepped else None, "lr": lr}

    def _calculate_metric(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        run = self._model(body)
        mean = sum(run.losses) / len(run.losses) if run.losses else None
        result = {
            "loss": mean,
            "cur_step": run.cur_step,
            "tokens": run.tokens,
            "is_training": body["is_training"],
        }
        run.losses, run.tokens = [], 0
        return {"result": result}

    def _get_train_configs(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"train_config": dict(self._model(body).config)}

    def _save(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        run = self._model(body)
        kind, name = body["kind"], body["name"]
        checkpoint_id = f"{kind}/{name}"
        tinker_path = f"tinker://{run.run_id}/{checkpoint_id}"
        run.checkpoints[checkpoint_id] = {
            "checkpoint_id": checkpoint_id,
            "checkpoint_type": "training" if kind == "weights" else "sampler",
            "time": self._now().isoformat(),
            "tinker_path": tinker_path,
            "size_bytes": 1024,
            "public": False,
            "user_metadata": None,
            "expires_at": None,
        }
        run.progress[checkpoint_id] = {
            "cur_step": run.cur_step,
            "consumed_train_samples": body["consumed_train_samples"],
            "gradient_accumulation_steps": run.config["gradient_accumulation_steps"],
        }
        return {"twinkle_path": "twinkle://" + tinker_path[len("tinker://") :], "path": tinker_path}

    def _resume(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        run = self._model(body)
        source, checkpoint_id = self._checkpoint(body["path"])
        progress = source.progress[checkpoint_id]
        run.cur_step = progress["cur_step"]
        return {"progress": progress}

    def _upload(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self._checkpoint(body["checkpoint_dir"])
        return {"hub_model_id": body["hub_model_id"], "url": f"https://hub.invalid/{body['hub_model_id']}"}

    def _sample(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("model_path"):
            self._checkpoint(body["model_path"])
        elif body.get("base_model") not in self.models:
            raise UserFailure(f"Base model {body.get('base_model')!r} is not served here.")
        tokens = body["prompt"]["chunks"][0]["tokens"]
        max_tokens = body["sampling_params"].get("max_tokens", 4)
        sequences = [
            {
                "tokens": [(t + i) % 50 for t in tokens[::-1]][:max_tokens],
                "logprobs": [-0.5] * min(max_tokens, len(tokens)),
                "stop_reason": "length",
            }
            for i in range(body["num_samples"])
        ]
        prompt_logprobs = [None] + [-1.0] * (len(tokens) - 1) if body.get("prompt_logprobs") else None
        return {"type": "sample", "sequences": sequences, "prompt_logprobs": prompt_logprobs}

    def _encode(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if body["template"] not in REGISTRIES["template"]:
            raise UserFailure(f"Unknown template {body['template']!r}.")
        features = []
        for row in body["rows"]:
            text = " ".join(m["content"] for m in row["messages"])
            ids = [ord(c) % 500 for c in text][: body["template_kwargs"].get("max_length", 64)]
            answer = len(row["messages"][-1]["content"])
            labels = [-100] * (len(ids) - min(answer, len(ids))) + ids[len(ids) - min(answer, len(ids)) :]
            features.append(
                {
                    "input_ids": ids,
                    "labels": labels,
                    "attention_mask": [1] * len(ids),
                    "extra": row.get("extra", {}),
                }
            )
        return {"features": features}

    # Lookups.

    def _model(self, body: dict[str, Any]) -> FakeRun:
        run = self.runs.get(body.get("model_id", ""))
        if run is None or not run.active:
            raise UserFailure(f"Model {body.get('model_id')} not found.")
        return run

    def _find_run(self, run_id: str) -> FakeRun:
        if run_id not in self.runs:
            raise LookupError(f"Training run {run_id} not found.")
        return self.runs[run_id]

    def _checkpoint(self, path: str) -> tuple[FakeRun, str]:
        match = re.fullmatch(r"(?:twinkle|tinker)://([^/]+)/(.+)", path)
        if (
            not match
            or match.group(1) not in self.runs
            or match.group(2) not in self.runs[match.group(1)].checkpoints
        ):
            raise UserFailure(f"Checkpoint {path} not found.")
        return self.runs[match.group(1)], match.group(2)

    def _now(self) -> datetime:
        self._clock += timedelta(seconds=1)
        return self._clock


def _error(status: int, message: str, category: str) -> httpx.Response:
    return httpx.Response(
        status,
        json={"error": message, "category": category, "code": f"http_{status}", "request_id": "rid-fake"},
        headers={"x-request-id": "rid-fake"},
    )
