"""Dependencies point one way: the API never imports torch, workers never import FastAPI, the client and the
wire types stay light, and the project's packages import each other in one direction only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


REPO = Path(__file__).resolve().parents[1]
# package -> the project's packages it must never import, at any depth (lazy imports inside functions included)
NEVER = {
    "twinkle": {"twinkle_client", "api", "workers", "cookbook", "bench", "tests"},
    "twinkle_client": {"api", "workers", "cookbook", "bench", "tests"},
    "api": {"workers", "cookbook", "bench", "tests"},
    "workers": {"api", "cookbook", "bench", "tests"},
}
# (module file, imported package): the one crossing kept, and why
ALLOWED = {("twinkle/server/cli.py", "twinkle_client")}  # `twinkle-server export-merged` is a client of a server


def project_imports(path: Path) -> set[str]:
    """The top-level packages `path` imports, absolute imports only (the project uses no relative ones)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def crossings(package: str) -> set[tuple[str, str]]:
    return {(str(path.relative_to(REPO)), imported)
            for path in (REPO / package).rglob("*.py")
            for imported in project_imports(path) & NEVER[package]}


@pytest.mark.parametrize("package", sorted(NEVER))
def test_package_imports_point_one_way(package: str) -> None:
    assert crossings(package) - ALLOWED == set()


def test_the_boundary_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from workers.pool import run\n    return run\n")
    assert project_imports(module) == {"workers"}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, by its full dotted name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


@pytest.mark.parametrize("package", ["api", "workers"])
def test_launched_processes_share_nothing_with_the_launcher_package_but_its_child_side_module(package: str) -> None:
    reaching = {(str(path.relative_to(REPO)), module) for path in (REPO / package).rglob("*.py")
                for module in imported_modules(path)
                if module == "twinkle.server" or module.startswith("twinkle.server.")}
    assert reaching == set()  # twinkle/launched_process.py is what they share with their launcher


# What a recipe may use: the client, the local data library, and the two entry points the product documents
# at the package root (`from twinkle import init_tinker_client`, `from twinkle import get_logger`).
COOKBOOK_MODULES = ("twinkle_client", "twinkle.dataset", "twinkle.dataloader", "twinkle.preprocessor",
                    "twinkle.template", "twinkle.data_format", "twinkle.input_feature")
COOKBOOK_ROOT_NAMES = {"twinkle.init_tinker_client", "twinkle.get_logger"}
PROJECT_PACKAGES = {"twinkle", "twinkle_client", "api", "workers", "tests", "bench"}


def cookbook_reaches(path: Path) -> set[str]:
    """The project modules (or, from the package root, the names) a recipe imports that it may not."""
    beyond: set[str] = set()
    for module in imported_modules(path):
        if module.split(".")[0] not in PROJECT_PACKAGES or module == "twinkle":
            continue
        if module not in COOKBOOK_ROOT_NAMES and not any(
                module == prefix or module.startswith(prefix + ".") for prefix in COOKBOOK_MODULES):
            beyond.add(module)
    return beyond


def test_the_cookbook_imports_only_the_client_and_the_data_library() -> None:
    reaching = {(str(path.relative_to(REPO)), module) for path in (REPO / "cookbook").rglob("*.py")
                for module in cookbook_reaches(path)}
    assert reaching == set()


def test_the_cookbook_check_sees_a_server_internal(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.py"
    recipe.write_text("def main():\n    from twinkle.server.common import input_feature_to_datum\n"
                      "    from twinkle import init_tinker_client\n")
    assert cookbook_reaches(recipe) == {"twinkle.server.common", "twinkle.server.common.input_feature_to_datum"}


# A future record's own fields: a Lua script that names one in quotes reads or moves a future.
FUTURE_FIELDS = ("status", "ticket", "created_at", "started_at", "finished_at", "exec_index", "begun_by",
                 "broker_run_id")
UNACKED_KEYS = {"unacked", "unacked_index"}  # kombu's, as strings
UNACKED_NAMES = {"UNACKED", "UNACKED_INDEX"}  # the ledger's names for them
RUNS_SCRIPTS = {"register_script", "eval", "evalsha"}


def ledger_names(tree: ast.AST) -> set[str]:
    """The names a module binds to the ledger's modules and values by importing them."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("twinkle.ledger"):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.startswith("twinkle.ledger")}
    return names


def ledger_trespasses(path: Path) -> set[str]:
    """What `path` does that only the ledger (twinkle/ledger/) may: a Lua script that touches a future record, the
    broker's unacked keys named, or a script of the ledger's registered or run by itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    from_ledger = ledger_names(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "redis.call(" in node.value and any(f"'{name}'" in node.value for name in FUTURE_FIELDS):
                found.add("a Lua script that touches a future")
            if node.value in UNACKED_KEYS:
                found.add(f"the key {node.value!r}")
        elif isinstance(node, ast.Name) and node.id in UNACKED_NAMES:
            found.add(f"the key {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in UNACKED_NAMES:
            found.add(f"the key {node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RUNS_SCRIPTS
              and node.args):
            root = node.args[0]
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in from_ledger:
                found.add(f"{node.func.attr} of a ledger script")
    return found


def test_only_the_ledger_moves_futures_and_reads_the_brokers_unacked_messages() -> None:
    """Every state transition of a future and every read of kombu's unacked hash goes through twinkle/ledger/, so its
    sync and async faces are the only ways to them."""
    ledger = REPO / "twinkle" / "ledger"
    trespassing = {str(path.relative_to(REPO)): found
                   for package in ("twinkle", "twinkle_client", "api", "workers")
                   for path in (REPO / package).rglob("*.py")
                   if ledger not in path.parents and (found := ledger_trespasses(path))}
    assert trespassing == {}


def test_the_ledger_check_sees_a_future_script_the_unacked_hash_and_a_ledger_script_run_elsewhere(
        tmp_path: Path) -> None:
    module = tmp_path / "elsewhere.py"
    module.write_text('from twinkle.ledger import scripts\n'
                      'FAIL = """\nredis.call(\'HSET\', KEYS[1], \'status\', \'failed\')\n"""\n'
                      'def held(r):\n    return r.hvals("unacked")\n'
                      'def begin(r):\n    return r.register_script(scripts.BEGIN)\n')
    assert ledger_trespasses(module) == {"a Lua script that touches a future", "the key 'unacked'",
                                         "register_script of a ledger script"}
