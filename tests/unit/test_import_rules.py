"""STYLE.md's layering, checked by parsing every import (nested ones too) of every module: one rule per package,
no per-file exemptions."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
OURS = {"fedge", "server", "edge_client", "export", "device_profiles", "launch"}
ALLOWED = {
    "device_profiles": set(),
    "fedge": {"device_profiles"},
    "server": {"fedge", "device_profiles"},
    "edge_client": {"fedge", "device_profiles"},
    "export": {"fedge", "device_profiles"},
    "launch": OURS - {"launch"},  # the composition root: CLI, simulation, deployment wiring
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & OURS


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
