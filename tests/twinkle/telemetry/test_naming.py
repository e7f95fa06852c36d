from __future__ import annotations

import numpy as np

from twinkle.telemetry.naming import deployment_of_queue, op_attributes, prometheus_name, session_of, span_name
from twinkle.telemetry.worker import trained_tokens
from twinkle.types import ForwardBackwardOutput


def test_each_pool_queue_maps_to_its_deployment_and_span_name() -> None:
    assert deployment_of_queue("model.models-tiny.3") == "Model"
    assert deployment_of_queue("sampler.sampler-tiny") == "Sampler"
    assert deployment_of_queue("processor.processor") == "Processor"
    assert deployment_of_queue("celery") == "Gateway"
    assert span_name("Sampler") == "twinkle.server.Sampler"


def test_the_session_is_read_from_model_and_sampling_session_ids() -> None:
    assert session_of("s0123abcd:train:4") == "s0123abcd"
    assert session_of("s0123abcd:sample:1712") == "s0123abcd"
    assert session_of("") == ""
    attributes = op_attributes("r1", "forward_backward", "s9:train:0", "model.m.0")
    assert attributes == {"twinkle.request_id": "r1", "twinkle.task_type": "forward_backward",
                          "twinkle.queue": "model.m.0", "twinkle.session_id": "s9", "twinkle.model_id": "s9:train:0"}
    assert "twinkle.model_id" not in op_attributes("r2", "sample", "s9:sample:5", "sampler.s")


def test_prometheus_names_follow_the_seeds_table() -> None:
    assert prometheus_name("twinkle.http.requests.total", "counter") == "twinkle_http_requests_total"
    assert prometheus_name("twinkle.tokens.trained", "counter") == "twinkle_tokens_trained_total"
    assert prometheus_name("twinkle.queue.depth", "gauge") == "twinkle_queue_depth"


def test_trained_tokens_count_one_logprob_per_target_token() -> None:
    out = ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": np.zeros(5)}, {"logprobs": np.zeros(7)}], metrics={})
    assert trained_tokens(out) == 12
    assert trained_tokens({"loss": 1.0, "logprobs": [[0.1, 0.2], [0.3]]}) == 3
    assert trained_tokens({"stepped": True}) == 0
