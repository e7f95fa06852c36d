"""The Tinker codec against the real SDK: the SDK writes the requests and reads the results."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from tinker import types as sdk
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.response_conv import deserialize_proto_response
from tinker.resources.sampling import AsyncSamplingResource
from tinker.resources.training import AsyncTrainingResource

from api.tinker_codec import (
    adam_params_from_json,
    decode_forward_backward,
    decode_model_input,
    encode_forward_backward_output,
    encode_sample_output,
    sampling_params_from_json,
    wire_schema,
)
from twinkle.errors import InvalidRequest, PayloadTooLarge
from twinkle.types import (
    ForwardBackwardOutput,
    ImageChunk,
    SampledSequence,
    SampleOutput,
    TextChunk,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 1 << 24
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
PROTOBUF = "application/x-protobuf"


# --- the SDK's own request writers, called with a client that records instead of POSTing ---------


def _recording_client(*, compress: bool = False) -> tuple[SimpleNamespace, dict[str, Any]]:
    sent: dict[str, Any] = {}

    async def post(path: str, *, body: Any, cast_to: Any, options: Any = None) -> None:
        sent.update(path=path, body=body, headers=(options or {}).get("headers", {}))

    client = SimpleNamespace(
        _client_config=sdk.ClientConfigResponse(proto_compress_fwdbwd=compress),
        get=None,
        post=post,
        patch=None,
        put=None,
        delete=None,
        get_api_list=None,
    )
    return client, sent


def sdk_forward_backward_body(
    data: list[sdk.Datum],
    loss_fn: Any = "cross_entropy",
    *,
    loss_fn_config: dict[str, float | str] | None = None,
    forward_only: bool = False,
    compress: bool = False,
    seq_id: int | None = 1,
) -> tuple[bytes, dict[str, str]]:
    """The body and headers `TrainingClient.forward_backward` would POST."""
    client, sent = _recording_client(compress=compress)
    request = sdk.ForwardBackwardRequest(
        forward_backward_input=sdk.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config),
        model_id="s1:train:0",
        seq_id=seq_id,
    )
    asyncio.run(AsyncTrainingResource(client).forward_backward(request=request, forward_only=forward_only))  # type: ignore[arg-type]
    assert sent["path"] == "/api/v1/forward_backward"
    return sent["body"], sent["headers"]


def sdk_sample_body(request: sdk.SampleRequest) -> dict[str, Any]:
    client, sent = _recording_client()
    asyncio.run(AsyncSamplingResource(client).asample(request=request))  # type: ignore[arg-type]
    return dict(sent["body"])


def sdk_optim_body(params: sdk.AdamParams) -> dict[str, Any]:
    client, sent = _recording_client()
    request = sdk.OptimStepRequest(optim_params=params, model_id="s1:train:0", seq_id=2)
    asyncio.run(AsyncTrainingResource(client).optim_step(request=request))  # type: ignore[arg-type]
    return dict(sent["body"])


def decode(body: bytes, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
    headers = headers or {"Content-Type": PROTOBUF}
    kwargs.setdefault("max_bytes", MAX_BYTES)
    return decode_forward_backward(body, headers["Content-Type"], headers.get("Content-Encoding"), **kwargs)


def inputs(**values: Any) -> Any:
    """Plain lists or arrays as loss inputs; the SDK's Datum converts them despite its annotation."""
    return values


def text_datum(tokens: list[int], **loss_fn_inputs: Any) -> sdk.Datum:
    return sdk.Datum(model_input=sdk.ModelInput.from_ints(tokens), loss_fn_inputs=loss_fn_inputs)


def ce_datum(tokens: list[int]) -> sdk.Datum:
    return text_datum(
        tokens,
        target_tokens=np.asarray([*tokens[1:], 0], dtype=np.int64),
        weights=np.linspace(0.0, 1.0, len(tokens), dtype=np.float32),
    )


def mutated(body: bytes, change: Any) -> bytes:
    """The SDK's body, parsed with the SDK's schema, changed by `change`, and serialized again."""
    msg = sdk_pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    change(msg)
    return bytes(msg.SerializeToString())


# --- forward_backward requests ----------------------------------------------------------------


def test_a_cross_entropy_batch_from_the_sdk_decodes_to_the_same_tokens_and_tensors() -> None:
    first = sdk.Datum(
        model_input=sdk.ModelInput(chunks=[sdk.EncodedTextChunk(tokens=[5, 6]), sdk.EncodedTextChunk(tokens=[7])]),
        loss_fn_inputs=inputs(target_tokens=[6, 7, 8], weights=[0.0, 1.0, 1.0]),
    )
    second = ce_datum([100, 200, 300, 400, 500])
    body, headers = sdk_forward_backward_body([first, second], seq_id=7)

    meta, batch, as_protobuf = decode(body, headers, vocab_size=1000)

    assert (meta.model_id, meta.seq_id, meta.forward_only, as_protobuf) == ("s1:train:0", 7, False, True)
    assert batch.loss_fn == "cross_entropy" and batch.loss_fn_config == {}
    assert [c.tokens.tolist() for c in batch.data[0].model_input if isinstance(c, TextChunk)] == [[5, 6], [7]]
    assert batch.data[0].tokens().dtype == np.int64
    np.testing.assert_array_equal(batch.data[1].tokens(), [100, 200, 300, 400, 500])
    for decoded, sent in zip(batch.data, [first, second], strict=True):
        assert decoded.loss_fn_inputs.keys() == sent.loss_fn_inputs.keys()
        for key, tensor in sent.loss_fn_inputs.items():
            assert decoded.loss_fn_inputs[key].dtype == tensor.to_numpy().dtype
            np.testing.assert_array_equal(decoded.loss_fn_inputs[key], tensor.to_numpy())


def test_forward_sets_forward_only_and_loss_config_merges_numbers_and_strings() -> None:
    datum = text_datum([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[-1.0, -2.0, -0.5], advantages=[1, 0, -1])
    config: dict[str, float | str] = {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
        "mode": "sequence",
    }
    body, headers = sdk_forward_backward_body([datum], "ppo", loss_fn_config=config, forward_only=True)

    meta, batch, _ = decode(body, headers)

    assert meta.forward_only is True
    assert batch.loss_fn == "ppo"
    assert batch.loss_fn_config == config
    assert batch.data[0].loss_fn_inputs["advantages"].dtype == np.float32


def test_a_v2_config_value_wins_over_the_legacy_number_map() -> None:
    body, _ = sdk_forward_backward_body([ce_datum([1, 2])], loss_fn_config={"beta": 0.5})
    body = mutated(body, lambda m: m.loss_fn_config.__setitem__("beta", 9.0))

    _, batch, _ = decode(body)

    assert batch.loss_fn_config == {"beta": 0.5}


def test_sparse_2d_target_tokens_from_torch_arrive_as_csr_and_decode_dense_with_zero_padding() -> None:
    targets = torch.zeros((6, 4), dtype=torch.int64)
    targets[0, 0], targets[2, 1], targets[2, 3], targets[5, 2] = 11, 12, 13, 14
    weights = torch.zeros((6, 4), dtype=torch.float32)
    weights[0, 0], weights[2, 3] = 1.0, 0.5
    datum = text_datum([1, 2, 3, 4, 5, 6], target_tokens=targets, weights=weights)
    body, headers = sdk_forward_backward_body([datum])
    wire = sdk_pb.ForwardBackwardRequest()
    wire.ParseFromString(body)
    assert wire.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"

    _, batch, _ = decode(body, headers, vocab_size=100)

    inputs = batch.data[0].loss_fn_inputs
    np.testing.assert_array_equal(inputs["target_tokens"], targets.numpy())
    np.testing.assert_array_equal(inputs["weights"], weights.numpy())
    assert inputs["target_tokens"].dtype == np.int64 and inputs["weights"].dtype == np.float32


def test_a_zstd_compressed_body_decodes_like_the_plain_one() -> None:
    data = [ce_datum(list(range(1, 50))), ce_datum([3, 4])]
    plain, _ = sdk_forward_backward_body(data)
    compressed, headers = sdk_forward_backward_body(data, compress=True)
    assert headers["Content-Encoding"] == "zstd" and compressed != plain

    _, from_zstd, _ = decode(compressed, headers)
    _, from_plain, _ = decode(plain)

    for a, b in zip(from_zstd.data, from_plain.data, strict=True):
        np.testing.assert_array_equal(a.tokens(), b.tokens())
        np.testing.assert_array_equal(a.loss_fn_inputs["weights"], b.loss_fn_inputs["weights"])


def test_a_zstd_body_that_inflates_past_the_limit_is_refused_as_too_large() -> None:
    bomb = zstandard.ZstdCompressor().compress(bytes(10_000_000))
    assert len(bomb) < 10_000

    with pytest.raises(PayloadTooLarge, match="decompresses"):
        decode_forward_backward(bomb, PROTOBUF, "zstd", max_bytes=1_000_000)


def test_a_body_over_the_limit_is_refused_before_parsing() -> None:
    body, headers = sdk_forward_backward_body([ce_datum(list(range(1, 300)))])

    with pytest.raises(PayloadTooLarge):
        decode(body, headers, max_bytes=len(body) - 1)


def test_image_chunks_keep_their_bytes_and_count_as_their_expected_tokens() -> None:
    model_input = sdk.ModelInput(
        chunks=[
            sdk.EncodedTextChunk(tokens=[1, 2]),
            sdk.ImageChunk(data=PNG, format="png", expected_tokens=3),
            sdk.EncodedTextChunk(tokens=[4]),
        ]
    )
    datum = sdk.Datum(model_input=model_input, loss_fn_inputs=inputs(target_tokens=[2, 0, 0, 0, 4, 5]))
    body, headers = sdk_forward_backward_body([datum])

    _, batch, _ = decode(body, headers)

    chunks = batch.data[0].model_input
    assert chunks[1] == ImageChunk(data=PNG, format="png", expected_tokens=3)
    np.testing.assert_array_equal(batch.data[0].tokens(), [1, 2, 4])


def test_an_image_without_expected_tokens_skips_the_length_check() -> None:
    model_input = sdk.ModelInput(chunks=[sdk.ImageChunk(data=PNG, format="jpeg"), sdk.EncodedTextChunk(tokens=[9])])
    datum = sdk.Datum(model_input=model_input, loss_fn_inputs=inputs(target_tokens=[1, 2, 3, 4]))
    body, _ = sdk_forward_backward_body([datum])

    _, batch, _ = decode(body)

    assert batch.data[0].images() == [ImageChunk(data=PNG, format="jpeg", expected_tokens=None)]


def _td_json(td: sdk.TensorData) -> dict[str, Any]:
    return {"data": td.data, "dtype": td.dtype, "shape": td.shape}


def _json_datum(datum: sdk.Datum) -> dict[str, Any]:
    return {
        "model_input": datum.model_input.model_dump(mode="json"),
        "loss_fn_inputs": {k: _td_json(v) for k, v in datum.loss_fn_inputs.items()},
    }


@pytest.mark.parametrize(("input_key", "forward_only"), [("forward_backward_input", False), ("forward_input", True)])
def test_the_0_16_json_shape_decodes_for_forward_backward_and_forward(input_key: str, forward_only: bool) -> None:
    datum = sdk.Datum(
        model_input=sdk.ModelInput(
            chunks=[
                sdk.EncodedTextChunk(tokens=[3, 4]),
                sdk.ImageChunk(data=PNG, format="png", expected_tokens=1),
            ]
        ),
        loss_fn_inputs=inputs(target_tokens=[4, 0, 5], weights=[1.0, 0.0, 1.0]),
    )
    body = {
        "model_id": "m1",
        "seq_id": 3,
        input_key: {
            "data": [_json_datum(datum)],
            "loss_fn": "ppo",
            "loss_fn_config": {"clip_low_threshold": 0.9},
        },
        "type": "forward",
    }

    meta, batch, as_protobuf = decode(json.dumps(body).encode(), {"Content-Type": "application/json; charset=utf-8"})

    assert (meta.model_id, meta.seq_id, meta.forward_only, as_protobuf) == ("m1", 3, forward_only, False)
    assert batch.loss_fn == "ppo" and batch.loss_fn_config == {"clip_low_threshold": 0.9}
    assert batch.data[0].model_input[1] == ImageChunk(data=PNG, format="png", expected_tokens=1)
    np.testing.assert_array_equal(batch.data[0].loss_fn_inputs["target_tokens"], [4, 0, 5])
    assert batch.data[0].loss_fn_inputs["target_tokens"].dtype == np.int64


def test_json_plain_lists_are_typed_by_key_and_json_csr_is_densified() -> None:
    body = {
        "model_id": "m1",
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                    "loss_fn_inputs": {
                        "weights": [1, 0, 1],
                        "target_tokens": {
                            "data": [7, 8],
                            "dtype": "int64",
                            "shape": [3, 2],
                            "sparse_crow_indices": [0, 1, 1, 2],
                            "sparse_col_indices": [1, 0],
                        },
                    },
                }
            ],
        },
    }

    meta, batch, _ = decode(json.dumps(body).encode(), {"Content-Type": "application/json"})

    assert meta.seq_id is None
    inputs = batch.data[0].loss_fn_inputs
    assert inputs["weights"].dtype == np.float32 and inputs["weights"].tolist() == [1.0, 0.0, 1.0]
    np.testing.assert_array_equal(inputs["target_tokens"], [[0, 7], [0, 0], [8, 0]])


# --- forward_backward request errors ------------------------------------------------------------


def _expect_invalid(body: bytes, *fragments: str, content_type: str = PROTOBUF, **kwargs: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode(body, {"Content-Type": content_type}, **kwargs)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


def _two_datums() -> bytes:
    return sdk_forward_backward_body([ce_datum([1, 2, 3]), ce_datum([4, 5, 6, 7])])[0]


def test_bytes_that_are_not_a_forward_backward_request_are_invalid() -> None:
    _expect_invalid(b"\xff\xff\xff\x0f garbage", "ForwardBackwardRequest")


def test_unknown_content_types_and_encodings_are_invalid() -> None:
    _expect_invalid(_two_datums(), "text/plain", content_type="text/plain")
    with pytest.raises(InvalidRequest, match="gzip"):
        decode_forward_backward(_two_datums(), PROTOBUF, "gzip", max_bytes=MAX_BYTES)
    with pytest.raises(InvalidRequest, match="zstd"):
        decode_forward_backward(b"not zstd at all", PROTOBUF, "zstd", max_bytes=MAX_BYTES)


def test_an_unknown_tensor_dtype_is_invalid_and_names_the_datum_and_key() -> None:
    body = mutated(_two_datums(), lambda m: setattr(m.data[1].loss_fn_inputs["weights"], "dtype", 0))
    _expect_invalid(body, "data[1]", "'weights'", "DTYPE_UNSPECIFIED")
    body = mutated(_two_datums(), lambda m: setattr(m.data[0].loss_fn_inputs["weights"], "dtype", 42))
    _expect_invalid(body, "data[0]", "42")


def test_a_shape_that_disagrees_with_the_data_size_is_invalid() -> None:
    def change(m: Any) -> None:
        tensor = m.data[1].loss_fn_inputs["target_tokens"]
        del tensor.shape[:]
        tensor.shape.extend([2, 3])

    _expect_invalid(mutated(_two_datums(), change), "data[1]", "'target_tokens'", "shape [2, 3]")


def test_dense_bytes_that_are_not_whole_values_are_invalid() -> None:
    def change(m: Any) -> None:
        tensor = m.data[0].loss_fn_inputs["weights"]
        tensor.dense = tensor.dense[:-1]

    _expect_invalid(mutated(_two_datums(), change), "data[0]", "'weights'", "bytes")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_float_inputs_are_invalid(bad: float) -> None:
    datum = text_datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, bad, 1.0])
    body, _ = sdk_forward_backward_body([ce_datum([1, 2]), datum])
    _expect_invalid(body, "data[1]", "'weights'", "NaN or infinite")


def test_negative_and_out_of_vocabulary_token_ids_are_invalid() -> None:
    negative, _ = sdk_forward_backward_body([ce_datum([1, 2]), text_datum([4, -3, 6], target_tokens=[1, 2, 3])])
    _expect_invalid(negative, "data[1].model_input", "-3")
    too_big, _ = sdk_forward_backward_body([text_datum([4, 5, 600], target_tokens=[1, 2, 3])])
    _expect_invalid(too_big, "data[0].model_input", "600", "[0, 500)", vocab_size=500)
    bad_target, _ = sdk_forward_backward_body([text_datum([4, 5, 6], target_tokens=[1, 2, 999])])
    _expect_invalid(bad_target, "data[0]", "'target_tokens'", "999", vocab_size=500)


def test_an_empty_batch_and_an_empty_model_input_are_invalid() -> None:
    empty_batch, _ = sdk_forward_backward_body([])
    _expect_invalid(empty_batch, "empty")
    empty_input, _ = sdk_forward_backward_body(
        [ce_datum([1]), sdk.Datum(model_input=sdk.ModelInput.empty(), loss_fn_inputs={})]
    )
    _expect_invalid(empty_input, "data[1].model_input", "empty")


def test_token_aligned_inputs_of_the_wrong_length_are_invalid() -> None:
    body, _ = sdk_forward_backward_body(
        [ce_datum([1, 2]), text_datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0])]
    )
    _expect_invalid(body, "data[1]", "'weights'", "3 tokens")
    with_image = sdk.Datum(
        model_input=sdk.ModelInput(
            chunks=[
                sdk.EncodedTextChunk(tokens=[1]),
                sdk.ImageChunk(data=PNG, format="png", expected_tokens=2),
            ]
        ),
        loss_fn_inputs=inputs(target_tokens=[1]),
    )
    body, _ = sdk_forward_backward_body([with_image])
    _expect_invalid(body, "data[0]", "'target_tokens'", "3 tokens")


def test_a_dmel_chunk_is_not_supported() -> None:
    body = mutated(_two_datums(), lambda m: setattr(m.data[1].model_input[0].dmel, "dmel", b"\x00\x01"))
    _expect_invalid(body, "data[1].model_input.chunks[0]", "not supported")


def test_float_target_tokens_are_invalid() -> None:
    body, _ = sdk_forward_backward_body([text_datum([1, 2], target_tokens=np.asarray([2.0, 3.0], np.float32))])
    _expect_invalid(body, "data[0]", "'target_tokens'", "int64")


def test_malformed_csr_indices_are_invalid() -> None:
    targets = torch.zeros((4, 3), dtype=torch.int64)
    targets[1, 2] = 5
    body, _ = sdk_forward_backward_body([text_datum([1, 2, 3, 4], target_tokens=targets)])

    def column_out_of_range(m: Any) -> None:
        m.data[0].loss_fn_inputs["target_tokens"].sparse_csr.col_indices = np.asarray([3], "<i8").tobytes()

    def rows_decreasing(m: Any) -> None:
        m.data[0].loss_fn_inputs["target_tokens"].sparse_csr.crow_indices = np.asarray([0, 1, 0, 1, 1], "<i8").tobytes()

    _expect_invalid(mutated(body, column_out_of_range), "data[0]", "'target_tokens'", "column")
    _expect_invalid(mutated(body, rows_decreasing), "data[0]", "'target_tokens'", "crow")


def test_a_sparse_tensor_that_densifies_past_the_limit_is_too_large() -> None:
    huge = {
        "data": [1],
        "dtype": "int64",
        "shape": [1, 10**9],
        "sparse_crow_indices": [0, 1],
        "sparse_col_indices": [0],
    }
    body = {
        "model_id": "m",
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                    "loss_fn_inputs": {"target_tokens": huge},
                }
            ],
        },
    }
    with pytest.raises(PayloadTooLarge, match="densifies"):
        decode(json.dumps(body).encode(), {"Content-Type": "application/json"})


def _json_body(datum: Any = None, **changes: Any) -> bytes:
    body: dict[str, Any] = {
        "model_id": "m",
        "seq_id": 1,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1.0, 1.0]},
                },
                datum
                or {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "loss_fn_inputs": {"target_tokens": [2, 3]},
                },
            ],
        },
    }
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        (b"{not json", ["JSON"]),
        (b"[1, 2]", ["object"]),
        (_json_body(model_id=""), ["model_id"]),
        (_json_body(seq_id=-1), ["seq_id"]),
        (_json_body(seq_id="1"), ["seq_id"]),
        (_json_body(forward_input={"data": []}), ["exactly one"]),
        (
            _json_body(
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                    "loss_fn_inputs": {"mask": [1]},
                }
            ),
            ["data[1]", "'mask'", "plain list"],
        ),
        (
            _json_body(
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                    "loss_fn_inputs": {"target_tokens": {"data": [1.5], "dtype": "int64"}},
                }
            ),
            ["data[1]", "'target_tokens'", "whole number"],
        ),
        (
            _json_body(
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                    "loss_fn_inputs": {"weights": {"data": ["1"], "dtype": "float32"}},
                }
            ),
            ["data[1]", "'weights'", "numbers"],
        ),
        (
            _json_body(
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                    "loss_fn_inputs": {"weights": {"data": [1.0], "dtype": "float64"}},
                }
            ),
            ["data[1]", "'weights'", "dtype"],
        ),
        (
            _json_body({"model_input": {"chunks": [{"type": "encoded_text", "tokens": ["a"]}]}}),
            ["data[1].model_input"],
        ),
        (_json_body({"model_input": {"chunks": []}}), ["data[1].model_input", "empty"]),
    ],
)
def test_malformed_json_requests_are_invalid(body: bytes, fragments: list[str]) -> None:
    _expect_invalid(body, *fragments, content_type="application/json")


def test_a_bad_loss_config_value_is_invalid() -> None:
    body = {
        "model_id": "m",
        "forward_backward_input": {
            "loss_fn": "ppo",
            "loss_fn_config": {"clip": [1]},
            "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]}}],
        },
    }
    _expect_invalid(json.dumps(body).encode(), "loss_fn_config['clip']", content_type="application/json")
    proto = mutated(_two_datums(), lambda m: m.loss_fn_config.__setitem__("beta", math.nan))
    _expect_invalid(proto, "loss_fn_config['beta']", "finite")


# --- forward_backward results -------------------------------------------------------------------


def sdk_reads_forward_backward(payload: bytes) -> sdk.ForwardBackwardOutput:
    """What `retrieve_future` hands the caller for an application/x-protobuf reply."""
    result = deserialize_proto_response(payload, sdk.ForwardBackwardOutput)
    assert isinstance(result, sdk.ForwardBackwardOutput)
    return result


def test_the_sdk_reads_per_datum_outputs_and_metrics_back_exactly() -> None:
    outputs = [
        {
            "logprobs": np.asarray([-0.5, -1.25, -2.0], np.float32),
            "elementwise_loss": np.asarray([0.5, 1.25, 2.0]),
        },
        {"logprobs": np.asarray([-3.0], np.float32), "elementwise_loss": np.asarray([3.0])},
    ]
    out = ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": 9.0, "tokens:sum": 4.0})

    result = sdk_reads_forward_backward(encode_forward_backward_output(out))

    assert result.loss_fn_output_type == "ArrayRecord"
    assert result.metrics == {"loss:sum": 9.0, "tokens:sum": 4.0}
    assert len(result.loss_fn_outputs) == 2
    for sent, got in zip(outputs, result.loss_fn_outputs, strict=True):
        assert got.keys() == sent.keys()
        for name, array in sent.items():
            assert got[name].dtype == "float32" and got[name].shape == [array.size]
            np.testing.assert_array_equal(got[name].to_numpy(), array.astype(np.float32))


def test_ragged_2d_and_integer_outputs_split_into_records_the_sdk_joins_in_order() -> None:
    outputs: list[dict[str, np.ndarray]] = [
        {"topk": np.arange(6, dtype=np.int64).reshape(3, 2), "logprobs": np.zeros(3, np.float32)},
        {"topk": np.arange(4, dtype=np.int64).reshape(2, 2), "logprobs": np.ones(2, np.float32)},
        {"topk": np.arange(3, dtype=np.int32).reshape(1, 3), "logprobs": np.full(1, -1.0, np.float32)},
    ]
    payload = encode_forward_backward_output(ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={}))
    wire = sdk_pb.ForwardBackwardOutput()
    wire.ParseFromString(payload)
    assert [r.num_datums for r in wire.loss_fn_outputs] == [2, 1]

    result = sdk_reads_forward_backward(payload)

    for sent, got in zip(outputs, result.loss_fn_outputs, strict=True):
        assert got["topk"].dtype == "int64" and got["topk"].shape == list(sent["topk"].shape)
        np.testing.assert_array_equal(got["topk"].to_numpy(), sent["topk"])
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), sent["logprobs"])


def test_an_output_without_datums_still_carries_its_metrics() -> None:
    result = sdk_reads_forward_backward(encode_forward_backward_output(ForwardBackwardOutput([], {"loss:sum": 1.5})))
    assert result.loss_fn_outputs == [] and result.metrics == {"loss:sum": 1.5}


@pytest.mark.parametrize("key", ["loss", "loss:sum:extra"])
def test_a_metric_key_without_exactly_one_colon_is_a_server_bug(key: str) -> None:
    with pytest.raises(ValueError, match="exactly one colon"):
        encode_forward_backward_output(ForwardBackwardOutput(loss_fn_outputs=[], metrics={key: 1.0}))


def test_datums_with_different_output_fields_are_a_server_bug() -> None:
    outputs = [{"logprobs": np.zeros(1)}, {"other": np.zeros(1)}]
    with pytest.raises(ValueError, match="same fields"):
        encode_forward_backward_output(ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={}))


# --- sample results -----------------------------------------------------------------------------


def sdk_reads_sample(payload: bytes) -> sdk.SampleResponse:
    result = deserialize_proto_response(payload, sdk.SampleResponse)
    assert isinstance(result, sdk.SampleResponse)
    return result


def test_the_sdk_reads_sequences_prompt_logprobs_and_padded_topk_back() -> None:
    out = SampleOutput(
        sequences=[
            SampledSequence(tokens=[7, 8, 9], logprobs=[-0.5, -1.5, -0.25], stop_reason="stop"),
            SampledSequence(tokens=[1], logprobs=[], stop_reason="length"),
        ],
        prompt_logprobs=[None, -1.0, -2.5],
        topk_prompt_logprobs=[[], [(5, -0.5), (6, -1.0), (7, -2.0)], [(3, -0.125)]],
    )

    result = sdk_reads_sample(encode_sample_output(out, num_prompt_tokens=3))

    first, second = result.sequences
    assert (first.tokens, first.logprobs, first.stop_reason) == ([7, 8, 9], [-0.5, -1.5, -0.25], "stop")
    assert (second.tokens, second.logprobs, second.stop_reason) == ([1], None, "length")
    assert result.prompt_logprobs == [None, -1.0, -2.5]
    assert result.topk_prompt_logprobs == [None, [(5, -0.5), (6, -1.0), (7, -2.0)], [(3, -0.125)]]
    assert result.topk_prompt_logprobs_np is not None
    assert result.topk_prompt_logprobs_np.token_ids[2].tolist() == [3, 0, 0]
    assert result.topk_prompt_logprobs_np.logprobs[2].tolist() == [-0.125, -99999.0, -99999.0]


def test_a_sample_without_prompt_logprobs_leaves_them_unset() -> None:
    result = sdk_reads_sample(encode_sample_output(SampleOutput([SampledSequence([4], [-1.0], "stop")]), 5))
    assert result.prompt_logprobs is None and result.topk_prompt_logprobs is None
    assert result.sequences[0].topk_logprobs is None


def test_the_sdk_reads_each_sampled_tokens_top_k_back() -> None:
    top = [[(7, -0.5), (3, -1.25)], [(8, -1.5)]]
    out = SampleOutput([SampledSequence([7, 8], [-0.5, -1.5], "length", topk_logprobs=top)])

    (sequence,) = sdk_reads_sample(encode_sample_output(out, num_prompt_tokens=2)).sequences

    assert sequence.topk_logprobs == top
    assert sequence.topk_logprobs_np is not None and sequence.topk_logprobs_np.token_ids.shape == (2, 2)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (SampleOutput([], prompt_logprobs=[None, -1.0]), "prompt has 3"),
        (SampleOutput([], topk_prompt_logprobs=[[(1, -1.0)]]), "prompt has 3"),
        (SampleOutput([SampledSequence([1], [-1.0], "eos")]), "stop_reason"),  # type: ignore[arg-type]
        (SampleOutput([SampledSequence([1, 2], [-1.0], "stop")]), "1 logprobs for 2 tokens"),
        (SampleOutput([SampledSequence([1, 2], [-1.0, -2.0], "stop", [[(1, -1.0)]])]), "1 top-k rows for 2 tokens"),
        (SampleOutput([SampledSequence([2**31], [-1.0], "stop")]), "int32"),
    ],
)
def test_inconsistent_sample_outputs_are_server_bugs(out: SampleOutput, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_sample_output(out, num_prompt_tokens=3)


# --- JSON model inputs and hyper-parameters -----------------------------------------------------


def _sample_request(**params: Any) -> sdk.SampleRequest:
    prompt = sdk.ModelInput(
        chunks=[
            sdk.EncodedTextChunk(tokens=[1, 2, 3]),
            sdk.ImageChunk(data=PNG, format="png", expected_tokens=4),
            sdk.EncodedTextChunk(tokens=[9]),
        ]
    )
    return sdk.SampleRequest(
        prompt=prompt,
        sampling_params=sdk.SamplingParams(**params),
        num_samples=2,
        sampling_session_id="ss",
        seq_id=0,
    )


def test_an_asample_prompt_from_the_sdk_decodes_to_text_and_image_chunks() -> None:
    body = sdk_sample_body(_sample_request(max_tokens=3))

    chunks = decode_model_input(body["prompt"], vocab_size=10)

    assert [c.tokens.tolist() for c in chunks if isinstance(c, TextChunk)] == [[1, 2, 3], [9]]
    assert chunks[1] == ImageChunk(data=PNG, format="png", expected_tokens=4)


@pytest.mark.parametrize(
    ("prompt", "fragments"),
    [
        ({"chunks": []}, ["empty"]),
        ({"chunks": [{"type": "encoded_text", "tokens": []}]}, ["empty"]),
        ({"chunks": [{"type": "encoded_text", "tokens": [1, 10]}]}, ["chunks[0]", "10", "[0, 10)"]),
        ({"chunks": [{"type": "encoded_text", "tokens": [True]}]}, ["chunks[0].tokens"]),
        ({"chunks": [{"type": "image", "data": "***", "format": "png"}]}, ["chunks[0].data", "base64"]),
        (
            {"chunks": [{"type": "image", "data": base64.b64encode(PNG).decode(), "format": "gif"}]},
            ["format"],
        ),
        (
            {
                "chunks": [
                    {
                        "type": "image",
                        "data": base64.b64encode(PNG).decode(),
                        "format": "png",
                        "expected_tokens": 0,
                    }
                ]
            },
            ["expected_tokens"],
        ),
        (
            {"chunks": [{"type": "image_asset_pointer", "format": "png", "location": "s3://x"}]},
            ["image_asset_pointer"],
        ),
        ({"chunks": [{"type": "dmel", "dmel": "AAAA"}]}, ["not supported"]),
        ({"chunks": [{"type": "video"}]}, ["'video'"]),
        ({"tokens": [1]}, ["chunks"]),
    ],
)
def test_malformed_json_model_inputs_are_invalid(prompt: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_model_input(prompt, vocab_size=10)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


def test_sampling_params_from_the_sdk_map_onto_twinkle_sampling_params() -> None:
    body = sdk_sample_body(_sample_request(max_tokens=3, temperature=0.7, top_k=20, top_p=0.9, seed=5, stop=["\n"]))

    params = sampling_params_from_json(body["sampling_params"])

    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.seed) == (
        3,
        0.7,
        20,
        0.9,
        5,
    )
    assert (params.stop_strings, params.stop_token_ids, params.stop_at_eos) == (("\n",), (), True)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, ((), (), True)),
        ([], ((), (), False)),
        ("END", ((), ("END",), True)),
        ([13, 14], ((13, 14), (), True)),
    ],
)
def test_stop_none_means_eos_only_and_an_empty_list_means_no_stop(stop: Any, expected: tuple[Any, ...]) -> None:
    body = sdk_sample_body(_sample_request(stop=stop))
    params = sampling_params_from_json(body["sampling_params"])
    assert (params.stop_token_ids, params.stop_strings, params.stop_at_eos) == expected


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": ["a", 1]}, "mix"),
        ({"stop": [-1]}, "stop"),
        ({"stop": [""]}, "empty string"),
    ],
)
def test_out_of_range_sampling_params_are_invalid(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        sampling_params_from_json(params)


def test_adam_params_from_the_sdk_map_onto_twinkle_adam_params() -> None:
    sent = sdk.AdamParams(learning_rate=3e-4, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)
    body = sdk_optim_body(sent)

    params = adam_params_from_json(body["adam_params"])

    assert (params.learning_rate, params.beta1, params.beta2, params.eps) == (3e-4, 0.8, 0.99, 1e-8)
    assert (params.weight_decay, params.grad_clip_norm) == (0.01, 1.0)
    assert adam_params_from_json({}) == adam_params_from_json(sdk_optim_body(sdk.AdamParams())["adam_params"])


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"learning_rate": -1e-4}, "learning_rate"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"eps": 0.0}, "eps"),
        ({"learning_rate": math.nan}, "finite"),
        ({"weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_out_of_range_adam_params_are_invalid(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        adam_params_from_json(params)


# --- packaging ----------------------------------------------------------------------------------


def test_the_codec_loads_without_torch_or_the_tinker_sdk() -> None:
    script = "import sys, api.tinker_codec; print(sorted({'torch', 'tinker'} & set(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]"


def test_the_copied_wire_schema_matches_the_installed_sdk() -> None:
    assert wire_schema.FILE_DESCRIPTOR.serialized_pb == sdk_pb.DESCRIPTOR.serialized_pb
