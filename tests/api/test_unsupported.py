"""Every route the Tinker SDK 0.38 calls is either served or answered as an SDK call Twinkle does not support."""

from __future__ import annotations

import re
from pathlib import Path

import tinker

from api.app import create_app
from api.unsupported import describe_missing_route
from tests.harness import mock_config
from twinkle.config.loader import parse_config

# `self._post("/api/v1/...")` in resources, `client.get(f"/api/v1/...")` in the public clients
_SDK_ROUTE = re.compile(r"""\.(?:_)?(get|post|put|delete|patch)\(\s*f?["'](/api/v1/[^"']*)["']""")


def sdk_routes() -> set[tuple[str, str]]:
    """(method, path template) of every request the installed SDK's resources and clients send."""
    found = set()
    for source in Path(tinker.__file__).parent.rglob("*.py"):
        if source.name.endswith("_test.py"):
            continue
        for method, path in _SDK_ROUTE.findall(source.read_text()):
            found.add((method.upper(), path))
    return found


def served_routes(tmp_path: Path) -> list[tuple[str, re.Pattern[str]]]:
    config = parse_config(mock_config(tmp_path, tmp_path / "ckpt", port=1, db=15))
    app = create_app(config, "redis://127.0.0.1:1/0")
    served = []
    for path, methods in app.openapi()["paths"].items():
        pattern = re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+(?:/[^/]+)?", path) + "$")
        served += [(method.upper(), pattern) for method in methods]
    return served


def test_every_sdk_route_is_served_or_named_as_unsupported(tmp_path: Path) -> None:
    routes = sdk_routes()
    assert len(routes) > 30 and ("POST", "/api/v1/create_model") in routes  # the scan found the SDK's calls
    served = served_routes(tmp_path)
    unanswered = []
    for method, template in sorted(routes):
        path = re.sub(r"\{[^}]+\}", "x1", template)
        if any(m == method and pattern.match(path) for m, pattern in served):
            continue
        code, message = describe_missing_route(method, path)
        if code != "unsupported" or "Tinker SDK call" not in message:
            unanswered.append((method, template))
    assert unanswered == []


def test_an_unknown_path_is_called_unknown_not_unsupported() -> None:
    code, message = describe_missing_route("GET", "/api/v1/definitely_not_a_route")
    assert code == "unknown_route" and "GET /api/v1/definitely_not_a_route" in message and "/docs" in message
