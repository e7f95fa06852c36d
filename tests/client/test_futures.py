from __future__ import annotations

import time

import pytest

import twinkle_client.futures as futures_module
from tests.client.fake_server import FakeTwinkleServer
from twinkle_client import FutureTimeout, GoneError, NotFoundError, RequestFailed, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

ENCODE = {"template": "Template", "template_kwargs": {}, "rows": []}


def test_a_try_again_answer_is_polled_again_until_the_result_arrives(
    client: TwinkleClient, server: FakeTwinkleServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(futures_module, "SHORT_POLL_BACKOFF_MAX", 0.01)
    server.try_again_per_future = 3
    future = client.submit("/twinkle/encode", ENCODE, lambda reply: reply["features"])
    assert future.result(timeout=5) == []
    assert future.done()
    assert len(server.sent("/retrieve_future")) == 4
    assert future.request_id and future.request_id in repr(future)


def test_a_failed_future_raises_request_failed_with_the_servers_message(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    model = MultiLoraTransformersModel("Qwen/Qwen3.5-4B")
    model.add_adapter_to_model("default", {"r": 4})
    with pytest.raises(RequestFailed, match=r"Unknown loss 'L1'\. Valid names: CrossEntropyLoss") as caught:
        model.set_loss("L1")
    assert caught.value.category == "user"
    assert caught.value.request_id is not None


def test_result_raises_the_same_error_again_without_polling_again(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    model = MultiLoraTransformersModel("Qwen/Qwen3.5-4B")
    model.add_adapter_to_model("default", {"r": 4})
    future = model.submit_set_optimizer("SGD")
    for _ in range(2):
        with pytest.raises(RequestFailed):
            future.result(timeout=5)
    polls = len(server.sent("/retrieve_future"))
    with pytest.raises(RequestFailed):
        future.result()
    assert len(server.sent("/retrieve_future")) == polls


def test_an_unknown_or_expired_future_raises_at_once_without_retrying(
    client: TwinkleClient, server: FakeTwinkleServer, sleeps: list[float]
) -> None:
    server.inject("POST", "/retrieve_future", status=404, error="Future req-1 not found.")
    with pytest.raises(NotFoundError, match="req-1 not found"):
        client.submit("/twinkle/encode", ENCODE, dict).result(timeout=5)
    server.inject("POST", "/retrieve_future", status=410, error="Future req-2 expired.")
    with pytest.raises(GoneError, match="expired"):
        client.submit("/twinkle/encode", ENCODE, dict).result(timeout=5)
    assert sleeps == []


def test_result_with_a_timeout_raises_future_timeout_and_the_future_can_still_finish(
    client: TwinkleClient, server: FakeTwinkleServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(futures_module, "SHORT_POLL_BACKOFF_MAX", 0.05)
    server.try_again_per_future = 8
    future = client.submit("/twinkle/encode", ENCODE, lambda reply: reply["features"])
    with pytest.raises(FutureTimeout, match=r"did not finish within 0\.01 s.*call result\(\) again"):
        future.result(timeout=0.01)
    assert future.result(timeout=5) == []


def test_instant_try_again_answers_are_polled_with_backoff_not_in_a_busy_loop(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    server.try_again_per_future = 10_000
    future = client.submit("/twinkle/encode", ENCODE, dict)
    with pytest.raises(FutureTimeout):
        future.result(timeout=0.6)
    assert len(server.sent("/retrieve_future")) <= 8  # 0.05, 0.1, 0.2, 0.4 s apart


def test_futures_resolve_in_the_background_so_done_never_blocks(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    pending = [client.submit("/twinkle/encode", ENCODE, lambda reply: reply["features"]) for _ in range(5)]
    deadline = time.monotonic() + 5
    while not all(f.done() for f in pending) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(f.done() for f in pending)


def test_a_request_queued_long_shows_a_progress_line_with_the_queue_reason(
    client: TwinkleClient,
    server: FakeTwinkleServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(futures_module, "QUEUE_NOTICE_SECONDS", 0.0)
    monkeypatch.setattr(futures_module, "SHORT_POLL_BACKOFF_MAX", 0.01)
    server.try_again_per_future = 2
    server.try_again_reason = "queued on model.tiny.0, 3 ahead"
    client.submit("/twinkle/encode", ENCODE, dict, label="forward_backward").result(timeout=5)
    err = capsys.readouterr().err
    assert "forward_backward" in err and "queued on model.tiny.0, 3 ahead" in err


def test_no_progress_line_shows_for_requests_answered_quickly(
    client: TwinkleClient, server: FakeTwinkleServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.try_again_per_future = 1
    client.submit("/twinkle/encode", ENCODE, dict).result(timeout=5)
    assert "queued" not in capsys.readouterr().err
