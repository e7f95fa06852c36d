from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

import pytest

import twinkle_client
from twinkle_client.errors import (
    APIError,
    AuthenticationError,
    ConnectionFailed,
    FutureTimeout,
    GoneError,
    InternalServerError,
    InvalidArgument,
    QuotaExceededError,
    RateLimitError,
    RequestFailed,
    TwinkleClientError,
    api_error,
)

ERRORS = [
    TwinkleClientError("root"),
    InvalidArgument("pass a dict"),
    ConnectionFailed("no answer"),
    FutureTimeout("too slow"),
    RequestFailed("user", "Unknown loss 'L1'.", "req-1", "invalid_request"),
    api_error(429, "Over the limit.", "rid-1", "rate_limited", "user"),
    api_error(503, "Queue down.", "rid-2", "broker_unavailable", "server"),
    api_error(403, "forward_backward refused: used 10 of 5.", "rid-3", "quota_exceeded", "user"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_pickle_with_their_fields_and_message(error: TwinkleClientError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_messages_carry_the_servers_message_and_the_request_id() -> None:
    assert (
        str(RequestFailed("user", "Unknown loss 'L1'.", "req-1"))
        == "user error: Unknown loss 'L1'. (request req-1)"
    )
    assert str(api_error(404, "Run r not found.", "rid")) == "HTTP 404: Run r not found. (request rid)"


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (401, AuthenticationError),
        (403, AuthenticationError),
        (410, GoneError),
        (429, RateLimitError),
        (500, InternalServerError),
        (503, InternalServerError),
        (418, APIError),
    ],
)
def test_statuses_map_to_their_class(status: int, cls: type[APIError]) -> None:
    error = api_error(status, "m")
    assert type(error) is cls and error.status == status


def test_a_used_up_quota_maps_to_its_own_class_by_its_code_and_other_403s_stay_authentication_errors() -> None:
    error = api_error(403, "forward_backward refused: ... resets at 2025-07-01T00:00:00Z.", "rid", "quota_exceeded")
    assert type(error) is QuotaExceededError and error.status == 403 and error.code == "quota_exceeded"
    assert "resets at" in str(error)
    assert type(api_error(403, "Signed URL expired.", "rid", "forbidden")) is AuthenticationError


def test_timeouts_and_bad_arguments_are_also_the_builtin_exceptions() -> None:
    assert isinstance(FutureTimeout("x"), TimeoutError)
    assert isinstance(InvalidArgument("x"), ValueError)


def test_the_package_exports_exactly_its_public_names() -> None:
    public = {
        name
        for name, value in vars(twinkle_client).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert sorted(twinkle_client.__all__) == sorted(public)


def test_importing_the_model_and_sampler_modules_stays_light() -> None:
    code = "import sys, twinkle_client.model, twinkle_client.sampler; print(' '.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    assert not loaded & {"torch", "transformers", "peft", "datasets", "fastapi", "celery", "api", "workers"}
