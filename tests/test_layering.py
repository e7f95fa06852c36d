"""Dependencies point one way: the API never imports torch, workers never import FastAPI, and the
client and the wire types stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize(
    ("statement", "forbidden"),
    [
        ("import api.app", {"torch", "transformers", "peft"}),
        ("import api.app", {"boto3", "botocore"}),  # only a configured export store loads them
        ("import workers.pool, workers.handlers", {"fastapi", "starlette", "torch"}),
        ("import twinkle.types, twinkle.errors", {"torch", "fastapi", "celery", "pydantic"}),
        ("import twinkle.backends.mock, twinkle.samplers.mock", {"torch", "transformers"}),
        ("import twinkle_client", {"torch", "fastapi", "celery", "api", "workers"}),
    ],
)
def test_modules_do_not_import_what_their_layer_forbids(statement: str, forbidden: set[str]) -> None:
    assert not (imported_after(statement) & forbidden)
