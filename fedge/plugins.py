"""Methods found through the `fedge.methods` entry points: fedge's own (declared in its pyproject.toml) and those of
any installed package, loaded half by half when a registry is first read.

An entry point names a method's package (`fedprox = "methods.fedprox"`, or `mymethod = "my_package.mymethod"`). Its
halves are submodules by convention, each optional: `models` registers its own layer types and model families
(fedge.model.layers' LAYER_TYPES, fedge.model.zoo's FAMILIES: what both sides need to build its models), `server`
registers strategies (server.strategy's STRATEGIES), `client` registers task handlers (edge_client.agent's TASKS). A
device importing the client halves never imports a server half, so `fedge client` stays free of server code. The
package itself (its __init__) may declare PAPER_FLEETS (strategy → fedge.config.PaperFleet: the fleet its paper ran
on), which the run's config reads on both sides.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

from fedge.errors import UserError

GROUP = "fedge.methods"
HALVES = ("models", "server", "client")


class PluginError(UserError):
    """An entry point of `fedge.methods` that is malformed or whose module fails to import; the message names its
    distribution and what to do."""


def method_entry_points() -> list[EntryPoint]:
    """The `fedge.methods` entry points of every installed distribution, fedge's own first (in the order its metadata
    lists them), then the others' by distribution; a name declared twice, or none of fedge's own (not installed),
    raises PluginError saying what to do."""
    found = sorted(entry_points(group=GROUP), key=lambda ep: (_distribution(ep) != "fedge", _distribution(ep)))
    seen: dict[str, EntryPoint] = {}
    for ep in found:
        if ep.name in seen and seen[ep.name].value != ep.value:
            raise PluginError(
                f"method {ep.name!r} is declared by {_distribution(seen[ep.name])} ({seen[ep.name].value}) and by "
                f"{_distribution(ep)} ({ep.value}); uninstall one of them"
            )
        seen.setdefault(ep.name, ep)
    declared = list(seen.values())
    if not any(_distribution(ep) == "fedge" for ep in declared):
        raise PluginError(
            "fedge's own methods are not declared: fedge is not installed in this environment, or a stale "
            "fedge.egg-info folder beside its sources hides its metadata; delete that folder and run "
            "`pip install -e .` (or `make test`, which sets up .venv)"
        )
    return declared


def package_attributes(name: str) -> dict[str, object]:
    """Entry point name → the attribute `name` of its package, for each declared method package that has one
    (importing the packages, not their halves); an import failure raises PluginError as load_methods does."""
    found = {}
    for ep in method_entry_points():
        package = _import(ep, ep.module)
        if hasattr(package, name):
            found[ep.name] = getattr(package, name)
    return found


def load_methods(half: str) -> list[str]:
    """Import the `half` submodule (models, server or client) of every declared method that has one, which registers
    what it holds; the names of the modules imported. A malformed entry point or a failing import raises PluginError."""
    if half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, got {half!r}")
    loaded = []
    for ep in method_entry_points():
        module = f"{ep.module}.{half}"
        _import(ep, ep.module)
        if importlib.util.find_spec(module) is not None:
            _import(ep, module)
            loaded.append(module)
    return loaded


def _import(ep: EntryPoint, module: str) -> ModuleType:
    if ep.attr:
        raise PluginError(
            f"entry point {ep.name} = {ep.value!r} of {_distribution(ep)} must name a package, not an object "
            f'(group {GROUP}: `name = "package.module"`)'
        )
    try:
        return importlib.import_module(module)
    except Exception as e:
        raise PluginError(
            f"method {ep.name!r} of {_distribution(ep)}: importing {module} failed: {type(e).__name__}: {e}. "
            f"Fix or uninstall that package (pip uninstall {_distribution(ep)})"
        ) from e


def _distribution(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "an unknown distribution"
