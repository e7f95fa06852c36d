"""The Twinkle-native routes over raw HTTP: server-side loss, accumulation, schedule, checkpoints, encode."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.test_foundation import new_model, wait
from tests.harness import LaunchedServer

pytestmark = pytest.mark.e2e


def feature(tokens: list[int], prompt_len: int = 2) -> dict[str, Any]:
    return {"input_ids": tokens, "labels": [-100] * prompt_len + tokens[prompt_len:]}


BATCH = [feature([5 + (i * 3 + k) % 40 for i in range(20)]) for k in range(4)]


def call(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return wait(c, r.json()["request_id"])


def test_a_twinkle_training_loop_accumulates_steps_and_resumes_exactly(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-twinkle") as c:
        model = new_model(c)
        config = call(c, "/twinkle/configure", {
            "model_id": model, "gradient_accumulation_steps": 2, "loss": "CrossEntropyLoss",
            "optimizer": "AdamW", "optimizer_kwargs": {"lr": 0.05}, "lr_scheduler": "CosineAnnealingLR",
            "lr_scheduler_kwargs": {"T_max": 20}})
        assert config["train_config"]["gradient_accumulation_steps"] == 2
        losses, steps = [], []
        for _ in range(6):
            out = call(c, "/twinkle/forward_backward", {"model_id": model, "inputs": BATCH})
            losses.append(out["loss"])
            assert len(out["logprobs"]) == len(BATCH) and len(out["logprobs"][0]) == 19
            steps.append(call(c, "/twinkle/clip_grad_and_step", {"model_id": model}))
        assert [s["stepped"] for s in steps] == [False, True] * 3
        assert steps[-1]["cur_step"] == 3 and steps[-1]["lr"] < 0.05
        metric = call(c, "/twinkle/calculate_metric", {"model_id": model, "is_training": True})["result"]
        assert metric["cur_step"] == 3 and metric["loss"] > 0 and metric["grad_norm"] > 0
        assert losses[-1] < losses[0]

        saved = call(c, "/twinkle/save", {"model_id": model, "name": "epoch-0", "save_optimizer": True,
                                          "consumed_train_samples": 24})
        assert saved["path"].endswith("/weights/epoch-0")
        call(c, "/twinkle/clip_grad_and_step", {"model_id": model})
        uninterrupted = call(c, "/twinkle/forward_backward", {"model_id": model, "inputs": BATCH})["loss"]

        resumed = new_model(c)
        progress = call(c, "/twinkle/resume_from_checkpoint", {"model_id": resumed, "path": saved["path"]})
        assert progress["progress"] == {"cur_step": 3, "consumed_train_samples": 24, "gradient_accumulation_steps": 2}
        call(c, "/twinkle/clip_grad_and_step", {"model_id": resumed})
        again = call(c, "/twinkle/forward_backward", {"model_id": resumed, "inputs": BATCH})["loss"]
        assert again == uninterrupted
        assert call(c, "/twinkle/get_train_configs", {"model_id": resumed})["train_config"]["lr_scheduler"] == \
            "CosineAnnealingLR"


def test_forward_only_with_disable_lora_reads_the_base_model(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-twinkle-base") as c:
        trained, fresh = new_model(c), new_model(c)  # a fresh LoRA adds nothing: it is the base model
        call(c, "/twinkle/configure", {"model_id": trained, "optimizer": "AdamW", "lr": 0.05})
        for _ in range(3):
            call(c, "/twinkle/forward_backward", {"model_id": trained, "inputs": BATCH})
            call(c, "/twinkle/clip_grad_and_step", {"model_id": trained})

        def logprobs(model: str, **options: Any) -> list[float]:
            out = call(c, "/twinkle/forward_only", {"model_id": model, "inputs": BATCH, **options})
            return [value for row in out["logprobs"] for value in row]

        base = logprobs(fresh)
        assert logprobs(trained, disable_lora=True) == pytest.approx(base, rel=1e-6)
        assert logprobs(trained) != pytest.approx(base, rel=1e-3)


def test_unknown_names_are_user_errors_listing_the_valid_ones(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-twinkle-names") as c:
        model = new_model(c)
        failed = call(c, "/twinkle/configure", {"model_id": model, "loss": "os.system"})
        assert failed["category"] == "user" and "CrossEntropyLoss" in failed["error"]
        bad = c.post("/twinkle/forward_backward", json={"model_id": model, "inputs": [{"input_ids": [1, 2]}]})
        assert bad.status_code == 400 and "labels" in bad.json()["error"]


def test_encode_runs_on_the_processor_pool(mock_server: LaunchedServer) -> None:
    with mock_server.client("tml-encode") as c:
        rows = [{"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "hi"}]}
                for i in range(6)]
        r = c.post("/twinkle/encode", json={"template": "Qwen3_5Template", "rows": rows,
                                            "template_kwargs": {"model_id": "tiny-qwen"}})
        assert r.status_code == 200, r.text
        features = wait(c, r.json()["request_id"])["features"]
        assert len(features) == 6
        assert all(len(f["input_ids"]) == len(f["labels"]) for f in features)
        assert any(label != -100 for label in features[0]["labels"])
        refused = c.post("/twinkle/encode", json={"template": "Qwen3_5Template", "rows": rows,
                                                  "template_kwargs": {"model_id": "hf://someone/else"}})
        assert refused.status_code == 400
