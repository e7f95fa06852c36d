from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import twinkle_client.futures as futures_module
from tests.client.fake_server import FakeTwinkleServer
from twinkle_client import FutureTimeout, InvalidArgument, RequestFailed, TwinkleClient
from twinkle_client.encoding import default_chunk_size, encode_remotely


def rows(count: int) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i:03d}"},
            ],
            "extra": {"row": i},
        }
        for i in range(count)
    ]


def test_rows_are_sent_in_chunks_and_the_features_come_back_in_row_order(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    features = encode_remotely(
        client, rows(23), "Qwen3_5Template", {"max_length": 64}, num_proc=2, chunk_size=5, progress=False
    )
    calls = server.sent("/twinkle/encode")
    assert [len(call.body["rows"]) for call in calls] == [5, 5, 5, 5, 3]
    assert [f["extra"]["row"] for f in features] == list(range(23))
    assert features[7]["input_ids"][-3:] == [ord(c) % 500 for c in "007"]


def test_several_chunks_are_in_flight_before_the_first_result_is_taken(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    encode_remotely(client, rows(40), "Template", {}, num_proc=2, chunk_size=5, progress=False)
    in_flight, most = 0, 0
    for event, _ in server.events:  # background polls may finish a chunk before the last submit of a burst
        in_flight += {"submit": 1, "retrieved": -1}.get(event, 0)
        most = max(most, in_flight)
    assert 2 <= most <= 4  # several chunks at once, never more than 2 x num_proc


def test_the_default_chunk_size_keeps_every_slot_busy_and_bodies_small() -> None:
    assert default_chunk_size(500, in_flight=2) == 125
    assert default_chunk_size(500, in_flight=16) == 16
    assert default_chunk_size(100_000, in_flight=2) == 256
    assert default_chunk_size(3, in_flight=16) == 1


def test_a_progress_bar_counts_the_encoded_rows(
    client: TwinkleClient, capsys: pytest.CaptureFixture[str]
) -> None:
    encode_remotely(client, rows(6), "Template", {}, chunk_size=3)
    err = capsys.readouterr().err
    assert "Encode (remote)" in err and "6/6" in err


def test_an_encode_that_outlasts_its_timeout_says_how_to_allow_more_time(
    client: TwinkleClient, server: FakeTwinkleServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(futures_module, "SHORT_POLL_BACKOFF_MAX", 0.05)
    server.try_again_per_future = 1000
    with pytest.raises(FutureTimeout, match=r"did not finish within 0.2 s .*timeout=3600"):
        encode_remotely(client, rows(4), "Template", {}, timeout=0.2, progress=False)


def test_a_chunk_the_server_refuses_fails_the_encode_with_its_message(client: TwinkleClient) -> None:
    with pytest.raises(RequestFailed, match="Unknown template 'Nope'"):
        encode_remotely(client, rows(2), "Nope", {}, progress=False)
    with pytest.raises(InvalidArgument, match="num_proc"):
        encode_remotely(client, rows(2), "Template", {}, num_proc=0)


def test_the_remote_dataset_encodes_on_the_server_and_keeps_the_local_api(
    client: TwinkleClient, server: FakeTwinkleServer
) -> None:
    from twinkle.dataloader import DataLoader
    from twinkle_client.dataset import Dataset

    dataset = Dataset.from_rows(rows(10))
    with pytest.raises(InvalidArgument, match="set_template"):
        dataset.encode()
    dataset.set_template("Qwen3_5Template", model_id="ms://Qwen/Qwen3.5-4B", max_length=32)
    assert dataset.template is None  # nothing is loaded locally: the server has the tokenizer
    assert dataset.encode(batched=True, num_proc=2, timeout=60) is dataset
    assert dataset.kind == "feature" and len(dataset) == 10
    first = dataset[0]
    assert isinstance(first["input_ids"], np.ndarray) and first["input_ids"].dtype == np.int64
    assert first["extra"] == {"row": 0}
    batches = list(DataLoader(dataset=dataset, batch_size=4))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [b["extra"]["row"] for b in batches[2]] == [8, 9]
    with pytest.raises(InvalidArgument, match="already encoded"):
        dataset.encode()
