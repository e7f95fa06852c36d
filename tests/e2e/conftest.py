from __future__ import annotations

import pytest

from tests.harness import LaunchedServer


@pytest.fixture(scope="module", params=["mock", "transformers"])
def server(request: pytest.FixtureRequest) -> LaunchedServer:
    """The server of an e2e module that launches none of its own: the shared mock server, then the shared
    transformers server, so that every test of the module runs against both backends."""
    launched: LaunchedServer = request.getfixturevalue(f"{request.param}_server")
    return launched
