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
    assert "api.services.futures" in imports["api.openai.routes"]  # a top-level import is seen


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
