"""`fedge new-method NAME`: a working method package to start from (launch/method_template/), found by fedge through
its own `fedge.methods` entry point once installed, without editing fedge."""

from __future__ import annotations

import argparse
import re
from importlib.metadata import entry_points
from pathlib import Path

from fedge.errors import UserError
from fedge.plugins import GROUP

TEMPLATE = Path(__file__).resolve().parent / "method_template"
NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


def write_method(name: str, parent: Path) -> Path:
    """Write the package `fedge-<name>` under `parent` (its pyproject.toml, the package `fedge_<name>` with its
    server half, client half and task settings, a README and a test) and return its folder. A name that is no
    lower-case identifier, that a strategy or an installed method already has, or a folder that exists, raises
    UserError saying what to choose."""
    from server.strategy import STRATEGIES

    if not NAME.fullmatch(name):
        raise UserError(f"method name {name!r}: use a lower-case letter, then up to 39 lower-case letters, digits or _")
    taken = set(STRATEGIES) | {ep.name for ep in entry_points(group=GROUP)}
    if name in taken:
        raise UserError(f"a method or strategy {name!r} exists (`fedge strategies` lists them); choose another name")
    folder = parent / f"fedge-{name}"
    if folder.exists():
        raise UserError(f"{folder} exists; choose another --dir or remove it")
    package = f"fedge_{name}"
    words = {"{{name}}": name, "{{package}}": package, "{{Name}}": "".join(w.title() for w in name.split("_"))}
    for template in sorted(TEMPLATE.rglob("*.tmpl")):
        relative = template.relative_to(TEMPLATE).with_suffix("")
        relative = Path(package, *relative.parts[1:]) if relative.parts[0] == "package" else relative
        if relative.name == "test_method.py":
            relative = relative.with_name(f"test_{name}.py")
        text = template.read_text()
        for word, value in words.items():
            text = text.replace(word, value)
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    return folder


def cmd_new_method(args: argparse.Namespace) -> None:
    folder = write_method(args.name, Path(args.dir))
    print(
        f"wrote {folder}: a FedAvg-like start (server half {folder.name.replace('-', '_')}/server.py, client half "
        f"client.py). Next:\n  cd {folder} && pip install -e .\n  fedge run --strategy {args.name} --zoo cnn1"
    )


def add_new_method_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "new-method",
        help="write a new method's package (server half, client half, test), found by fedge once installed",
        description="Write fedge-NAME/: a package whose `fedge.methods` entry point fedge finds once it is installed "
        "(pip install -e fedge-NAME): `fedge strategies` lists it, `fedge run --strategy NAME` and `fedge client` "
        "run it. As written it is FedAvg with its own client task, ready to edit.",
    )
    p.add_argument("name", help="the method's (and its strategy's) name: lower-case letters, digits, _")
    p.add_argument("--dir", default=".", help="where to write fedge-NAME/ (default: here)")
    p.set_defaults(func=cmd_new_method)
