"""STYLE.md's layering, checked by parsing every import (nested ones too) of every module: one rule per package,
no per-file exemptions."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
OURS = {"fedge", "server", "edge_client", "methods", "export", "device_profiles", "launch"}
ALLOWED = {
    "device_profiles": set(),
    "fedge": {"device_profiles"},
    "server": {"fedge", "device_profiles"},
    "edge_client": {"fedge", "device_profiles"},
    "export": {"fedge", "device_profiles"},
    # a method's halves on the shared machinery; its client half imports no server code (test below)
    "methods": {"fedge", "server", "edge_client", "device_profiles"},
    "launch": OURS - {"launch"},  # the composition root: CLI, simulation, deployment wiring
}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (nested imports too), as dotted names; `from a import b` gives a and a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)} & OURS


def module_path(name: str) -> Path | None:
    """The file of a module of ours (a package's __init__.py), None for a name that is no module (a class)."""
    for candidate in (ROOT / (name.replace(".", "/") + ".py"), ROOT / name.replace(".", "/") / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def closure(path: Path) -> dict[str, set[str]]:
    """Every module of ours that `path` imports, directly or through others of ours: file → the packages it
    imports."""
    seen: dict[str, set[str]] = {}
    todo = [path]
    while todo:
        p = todo.pop()
        if str(p) in seen:
            continue
        seen[str(p)] = imported_packages(p)
        for name in imported_modules(p):
            parts = name.split(".")
            # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            for i in range(1, len(parts) + 1):
                if parts[0] in OURS and (found := module_path(".".join(parts[:i]))) is not None:
                    todo.append(found)
    return seen


def modules():
    for package in sorted(ALLOWED):
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


@pytest.mark.parametrize("package, path", list(modules()), ids=lambda v: str(v).split(str(ROOT) + "/")[-1])
def test_layering(package, path):
    rel = path.relative_to(ROOT).as_posix()
    bad = imported_packages(path) - ALLOWED[package] - {package}
    assert not bad, f"{rel} imports {sorted(bad)}; {package} may only import {sorted(ALLOWED[package])}"


@pytest.mark.parametrize("package, path", list(modules()), ids=lambda v: str(v).split(str(ROOT) + "/")[-1])
def test_torchvision_is_never_imported_at_module_level(package, path):
    tree = ast.parse(path.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(n.split(".")[0] == "torchvision" for n in names)


CLIENT_HALVES = sorted((ROOT / "methods").glob("*/client.py"))


@pytest.mark.parametrize("path", CLIENT_HALVES, ids=lambda p: p.parent.name)
def test_a_methods_client_half_imports_no_server_code_even_indirectly(path):
    # what `fedge client` loads through fedge.plugins on a device (tests/integration checks the running process)
    bad = {f: pkgs & {"server", "export", "launch"} for f, pkgs in closure(path).items()}
    assert not any(bad.values()), {f.split(str(ROOT) + "/")[-1]: sorted(b) for f, b in bad.items() if b}


def test_the_client_halves_are_found():
    assert {p.parent.name for p in CLIENT_HALVES} >= {"dcpfl", "fedmn"}


def test_nothing_imports_the_launchers():
    users = [
        p.relative_to(ROOT).as_posix()
        for package, p in modules()
        if package != "launch"
        if "launch" in imported_packages(p)
    ]
    assert not users


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from server.coordinator import Coordinator\n")
    assert imported_packages(bad) == {"server"}


def test_the_closure_catches_a_server_import_one_module_away(tmp_path):
    half = tmp_path / "client.py"
    half.write_text("from methods.dcpfl.server import DCPFL\n")  # a module of ours that imports server code
    assert "server" in set().union(*closure(half).values())
