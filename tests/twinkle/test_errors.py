"""Errors cross process boundaries (Celery, Redis blobs): every class pickles with its message, hint and details."""

from __future__ import annotations

import pickle

import pytest

from twinkle import errors
from twinkle.errors import QuotaExceeded, TwinkleError


def _subclasses(cls: type[TwinkleError]) -> list[type[TwinkleError]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


ERRORS = sorted({c for c in _subclasses(TwinkleError) if c.__module__ == errors.__name__}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_pickles_with_its_fields(cls: type[TwinkleError]) -> None:
    error = cls("Something is wrong.", hint="Do this instead.", used=3, limit=2, resets_at=None)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert (copy.message, copy.hint, copy.details) == (error.message, error.hint, error.details)
    assert copy.to_dict() == error.to_dict()


def test_a_used_up_quota_is_a_user_error_the_tinker_sdk_raises_instead_of_retrying() -> None:
    # 402 would be a silent hour-long "billing pause", 429 minutes of retries; 403 is raised at once
    assert QuotaExceeded.status_code == 403 and QuotaExceeded.code == "quota_exceeded"
    assert QuotaExceeded.category == "user"
