"""Route modules sit on top: they call api/services and the codecs, never one another, so every protocol
(Tinker, Twinkle, OpenAI, the console) shares one service layer. Read from the source by AST, so an import
inside a function counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "api"
APP_MODULES = frozenset({"api.app", "api.routes"})  # the app mounts the routers; the package is theirs
ROUTE_MODULES = ("api.openai.routes", "api.console.routes")  # besides everything under api.routes


def module_name(path: Path) -> str:
    parts = list(path.relative_to(API.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> Iterator[str]:
    """Every module `path` imports, at any depth: `from a import b` names both `a` and `a.b` (b may be a
    module), relative imports are resolved, and `importlib.import_module("...")` with a literal counts too."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.args[0].value


def imports_by_module() -> dict[str, set[str]]:
    return {module_name(path): set(imported_modules(path)) for path in sorted(API.rglob("*.py"))}


def is_api_routes(name: str) -> bool:
    return name == "api.routes" or name.startswith("api.routes.")


def is_route_module(name: str) -> bool:
    return is_api_routes(name) or name in ROUTE_MODULES


def test_the_api_package_is_found_and_its_imports_are_read() -> None:
    imports = imports_by_module()
    assert "api.app" in imports and "api.routes.futures" in imports["api.app"]
    assert "api.services.sampling" in imports["api.openai.routes"]  # a top-level import is seen


def test_no_module_but_the_app_imports_from_api_routes() -> None:
    offenders = {module: sorted(filter(is_api_routes, names))
                 for module, names in imports_by_module().items() if module not in APP_MODULES}
    assert {module: names for module, names in offenders.items() if names} == {}


def test_the_openai_routes_and_the_console_import_no_api_routes_module() -> None:
    offenders = {module: sorted(filter(is_api_routes, names))
                 for module, names in imports_by_module().items()
                 if module.startswith(("api.openai", "api.console"))}
    assert {module: names for module, names in offenders.items() if names} == {}


def test_no_route_module_of_any_protocol_is_imported_but_by_the_app() -> None:
    offenders = {module: sorted(name for name in names if is_route_module(name) and name != module)
                 for module, names in imports_by_module().items() if module not in APP_MODULES}
    assert {module: names for module, names in offenders.items() if names} == {}


# The storage layer: the only api modules that import redis, hold a client or send it commands. Routes, services,
# the console, the OpenAI endpoint and the codecs ask these, never Redis.
STORAGE_LAYER = frozenset({
    "api.store",  # sessions, models and runs, checkpoint indexes, futures
    "api.redis_client",  # the clients the app builds, and the errors that mean the broker is down
    "api.pool_state",  # what the pools publish and hold
    "api.reservations",  # pools held by full-parameter runs, read with the client its callers hand it
    "api.stability_records",  # sample requests recorded for stable_reinforce
    "api.usage_history",  # the usage ledger, for reports
    "api.quotas",
    "api.ratelimit",
    "api.hub",
    "api.lost_futures",
    "api.checkpoint_writes",
})
CLIENT_CALLS = frozenset({"pipeline", "pubsub", "register_script"})  # what only a Redis client answers


def redis_uses(path: Path) -> Iterator[str]:
    """Where a module imports redis, reaches a client (`<anything>.r`) or asks one for a pipeline, a pub/sub
    connection or a script."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (f"line {node.lineno}: import {alias.name}" for alias in node.names
                        if alias.name.split(".")[0] == "redis")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "redis":
            yield f"line {node.lineno}: from {node.module} import"
        elif isinstance(node, ast.Attribute) and node.attr == "r":
            yield f"line {node.lineno}: {ast.unparse(node)}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in CLIENT_CALLS):
            yield f"line {node.lineno}: {ast.unparse(node.func)}()"


def test_every_storage_layer_module_exists() -> None:
    assert set(imports_by_module()) >= STORAGE_LAYER


def test_redis_is_reached_only_through_the_storage_layer() -> None:
    offenders = {module_name(path): list(redis_uses(path)) for path in sorted(API.rglob("*.py"))
                 if module_name(path) not in STORAGE_LAYER}
    assert {module: uses for module, uses in offenders.items() if uses} == {}


def test_the_services_import_no_protocol_module() -> None:
    protocols = ("api.routes", "api.openai", "api.console", "api.tinker_codec")
    offenders = {module: sorted(name for name in names if name in protocols or name.startswith(
                     tuple(f"{p}." for p in protocols)))
                 for module, names in imports_by_module().items() if module.startswith("api.services")}
    assert {module: names for module, names in offenders.items() if names} == {}
