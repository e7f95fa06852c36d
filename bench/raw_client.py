"""The raw-HTTP client the benchmarks drive a server with: one session, one model, a 32-token datum."""

from __future__ import annotations

from typing import Any

import httpx


def datum(n: int = 32) -> dict[str, Any]:
    """A next-token datum of `n` tokens in the Tinker JSON wire form."""
    tokens = [(7 * i) % 400 + 3 for i in range(n + 1)]
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"},
                               "weights": {"data": [1.0] * n, "dtype": "float32"}}}


class Client:
    def __init__(self, api: str, key: str, *, timeout: float = 60) -> None:
        self.c = httpx.Client(base_url=api, headers={"X-API-Key": key}, timeout=timeout)
        sid = self.c.post("/create_session", json={"tags": []}).json()["session_id"]
        r = self.c.post("/create_model", json={"session_id": sid, "base_model": "tiny-qwen",
                                               "lora_config": {"rank": 8}}).json()
        assert "model_id" in r, r
        self.wait(r["request_id"])
        self.model = r["model_id"]
        self.session = sid
        self.fb = {"model_id": self.model, "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"}}

    def wait(self, rid: str) -> dict[str, Any]:
        while True:
            body: dict[str, Any] = self.c.post("/retrieve_future", json={"request_id": rid}).json()
            if body.get("type") != "try_again":
                return body

    def step(self) -> None:
        """forward_backward and optim_step, submitted back to back, both waited for."""
        a = self.c.post("/forward_backward", json=self.fb).json()["request_id"]
        b = self.c.post("/optim_step", json={"model_id": self.model, "adam_params": {}}).json()["request_id"]
        self.wait(a)
        self.wait(b)

    def op(self) -> None:
        self.wait(self.c.post("/forward_backward", json=self.fb).json()["request_id"])
