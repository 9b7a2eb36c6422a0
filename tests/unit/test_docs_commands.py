"""Every `fedge` command shown in README.md and docs/*.md is checked, most of them by running it, so the docs cannot
rot.

Collected: each line of a fenced block (```bash, sh, shell, console, text, or none) that starts with `fedge `
(or `$ fedge `), joined with the lines after it when it ends in a backslash, or, in a ```text block, with the
indented lines after it. docs/results* are left out (they quote the commands of past runs).

- A synopsis (every line of a ```text block, and any line with `[...]` or `a|b`): its subcommand exists, every
  `--flag` it names is one that subcommand's parser (`launch.cli.build_parser`) has, and the alternatives it lists
  for a flag with fixed choices (or for --strategy) are among them.
- Any other line is a command (its trailing `# comment` dropped): `build_parser().parse_args` accepts it and every
  `--flag` in it is spelled out in full (argparse would take a prefix); then it runs in this process through
  `launch.cli.main` and must exit 0:
  - `fedge run` at small scale: RUN_OVERRIDES and RUN_SETTINGS (in process, one round, 40 samples a client) and
    whichever of FAST_OPTIONS the run's strategy has;
  - `fedge zoo | profiles | data | strategies | predict` and any `--help` as written;
  - `fedge run ... --out DIR`, `fedge broker --write-*-config` and `fedge export` once each, in the `workspace`
    fixture, runs first and exports last: every command runs in that one folder, so the docs' `runs/tour` is what
    the README's own `fedge run --out runs/tour` made and a `fedge predict deploy/...` reads what a docs
    `fedge export` wrote. The folder also holds what the docs tell the reader to make by hand (`_setup_files`).
  Parsed only: `fedge server`, `fedge client` and a serving `fedge broker` (they wait on a broker or serve one),
  `fedge doctor` (it spawns a fresh interpreter for seconds), and a command naming a word of PARSE_ONLY_WORDS; the
  files a parsed-only command names with FILE_FLAGS must be in the workspace (made by a docs command, or a ```toml
  block) or be listed in DOCUMENTED_ELSEWHERE. A command naming `../shared/data/...` reads the benchmark data beside
  the repository, and is skipped on a machine without it.
- Every ```toml block loads as a run config; one whose first line is `# NAME.toml...` is that file in the workspace.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import io
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from fedge.config import load_config, parse_overrides
from launch.cli import build_parser, main

pytestmark = [pytest.mark.timeout(240), pytest.mark.full]  # ~50 s: `make test`, not `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
SHARED_PREFIX = "../shared/data/"
SHARED_DATA = ROOT.parent / "shared" / "data"  # what ../shared/data/ names, from the repository root
DOC_FILES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("results"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "text"}

# appended to every executed `fedge run`: the command's own flags stay, these make it a few seconds long
RUN_OVERRIDES = ("--transport", "inproc", "--rounds", "1", "--no-progress")
RUN_SETTINGS = {"workers": "1", "max_samples_per_client": "40", "max_public_samples": "64", "export_onnx": "false"}
FAST_OPTIONS = {"max_candidates": "2", "finetune_min_steps": "0", "finetune_epochs": "1"}  # those the strategy has
RUNS_AS_WRITTEN = {"zoo", "profiles", "data", "strategies", "predict"}
PRODUCERS = ("run", "broker", "export")  # in the order the workspace fixture runs them
FILE_FLAGS = ("--config", "--password-file", "--users")
# a word that makes a command parse-only, and why
PARSE_ONLY_WORDS = {
    "RUN_DIR": "docs/android.md's run folder: its worked example is a digits run whose client 1 trains under "
    "ExecuTorch (a minute to make); docs/export.md runs the same exports on the README's runs/tour",
}
# files that parse-only commands name and no docs command writes, and where the docs say they come from
DOCUMENTED_ELSEWHERE = {
    "my-password": "a device's own line of broker/users, handed to it by the operator (docs/deployment.md)",
}


@dataclass(frozen=True)
class DocLine:
    """One `fedge` line of a fenced block: where it is, its text (comment kept), and whether it is a synopsis."""

    path: Path
    line: int
    text: str
    synopsis: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def words(self) -> list[str]:
        """The words after `fedge`, the trailing comment dropped."""
        return shlex.split(self.text, comments=True)[1:]

    @property
    def argv(self) -> list[str]:
        """The words, with `../shared/data/...` made absolute (the docs' commands run in the repository root)."""
        return [str(SHARED_DATA / w[len(SHARED_PREFIX) :]) if w.startswith(SHARED_PREFIX) else w for w in self.words]


@dataclass(frozen=True)
class TomlBlock:
    path: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def file_name(self) -> str | None:
        named = re.match(r"#\s*([\w.-]+\.toml)\b", self.text)
        return named.group(1) if named else None


def _blocks(path: Path) -> Iterator[tuple[str, int, list[str]]]:
    """(language, line number of its first line, lines) of every fenced block of a markdown file."""
    fence, lang, start, body = None, "", 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        opening = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and opening:
            fence, lang, start, body = opening.group(1), opening.group(2).lower(), number + 1, []
        elif fence is not None and line.strip() == fence:
            yield lang, start, body
            fence = None
        elif fence is not None:
            body.append(line)


def _is_synopsis(text: str) -> bool:
    code = text.split(" #", 1)[0]
    return bool(re.search(r"\[[^\]]*\]", code) or re.search(r"\w\|\w", code))


def collect() -> tuple[list[DocLine], list[TomlBlock]]:
    """Every `fedge` line and every ```toml block of the docs, in file order."""
    lines, tomls = [], []
    for path in DOC_FILES:
        for lang, start, body in _blocks(path):
            if lang == "toml":
                tomls.append(TomlBlock(path, start, "\n".join(body)))
            if lang not in SHELL_BLOCKS:
                continue
            i = 0
            while i < len(body):
                text, number = re.sub(r"^\$\s+", "", body[i].strip()), start + i
                i += 1
                if not text.startswith("fedge "):
                    continue
                while i < len(body) and (
                    text.endswith("\\") or (lang == "text" and body[i][:1].isspace() and body[i].strip())
                ):
                    text = text.removesuffix("\\").rstrip() + " " + body[i].strip()
                    i += 1
                lines.append(DocLine(path, number, text, lang == "text" or _is_synopsis(text)))
    return lines, tomls


LINES, TOMLS = collect()


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _asks_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def _kind(argv: list[str]) -> str:
    """`produce` (run once in the workspace fixture), `run` (in its test) or `parse` (parsed only)."""
    command = argv[0]
    if any(word.split("/")[0] in PARSE_ONLY_WORDS for word in argv):
        return "parse"
    if _asks_help(argv) or command in RUNS_AS_WRITTEN:
        return "run"
    if command == "run":
        return "produce" if "--out" in argv else "run"
    if command == "export" or (command == "broker" and any(a.startswith("--write-") for a in argv)):
        return "produce"
    return "parse"  # server, client, a serving broker, doctor


def _shared_missing(line: DocLine) -> str | None:
    for word in line.words:
        if word.startswith(SHARED_PREFIX) and not (SHARED_DATA / word[len(SHARED_PREFIX) :]).exists():
            return word
    return None


# ------------------------------------------------------------------ running commands


@dataclass(frozen=True)
class Outcome:
    status: int
    output: str


def execute(argv: list[str]) -> Outcome:
    """`fedge ARGV` in this process, its stdout and stderr captured; SystemExit (argparse, --help) is its status."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Outcome(int(status or 0), out.getvalue())


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@dataclass
class Workspace:
    """The folder every command runs in, and each command's outcome (a command shown twice runs once)."""

    path: Path
    outcomes: dict[tuple[str, ...], Outcome] = field(default_factory=dict)

    def run(self, argv: list[str]) -> Outcome:
        if tuple(argv) not in self.outcomes:
            with _cwd(self.path):
                self.outcomes[tuple(argv)] = execute(argv)
        return self.outcomes[tuple(argv)]

    def small_run(self, argv: list[str], out: str | None) -> list[str]:
        """A docs `fedge run` with RUN_OVERRIDES, RUN_SETTINGS and the FAST_OPTIONS its strategy has; into `out`, or
        (None) into the docs' own --out with its teachers exported, as later docs commands read them."""
        from server.strategy import STRATEGIES

        args = build_parser().parse_args(argv)
        chosen = {"strategy": args.strategy} if args.strategy else {}
        config = self.path / args.config if args.config else None
        strategy = load_config(config, chosen | parse_overrides(args.set or [])).strategy
        has = {name for name, *_ in STRATEGIES.get(strategy).options_type.describe()}
        settings = RUN_SETTINGS | {k: v for k, v in FAST_OPTIONS.items() if k in has}
        if out is None:
            settings["export_onnx"] = "true"
        extra = [*RUN_OVERRIDES, *(["--out", out] if out else [])]
        return [*argv, *extra, *(w for k, v in settings.items() for w in ("--set", f"{k}={v}"))]

    def produced(self, argv: list[str]) -> list[str]:
        """The argv a producing command runs as: runs small, broker files owned by whoever runs the tests (the
        docs' default owners, mosquitto and rabbitmq, exist only where their packages are installed)."""
        if argv[0] == "run":
            return self.small_run(argv, None)
        if argv[0] == "broker" and "--run-as" not in argv:
            return [*argv, "--run-as", getpass.getuser()]
        return argv


def _setup_files(path: Path) -> None:
    """What the docs tell the reader to make by hand: their named toml files, my-device.toml (docs/models-and-profiles:
    a copy of rpi-4.toml under its own name) and my_digits/ (docs/export.md: class folders of PNG images)."""
    from PIL import Image

    from fedge.data.datasets import load_dataset

    for block in TOMLS:
        if block.file_name:
            (path / block.file_name).write_text(block.text + "\n")
    profile = (ROOT / "device_profiles" / "profiles" / "rpi-4.toml").read_text()
    (path / "my-device.toml").write_text(re.sub(r"(?m)^name\s*=.*$", 'name = "my-device"', profile))
    digits = load_dataset("mnist-5k")
    for label, name in enumerate(digits.classes):
        folder = path / "my_digits" / name
        folder.mkdir(parents=True)
        for i, index in enumerate((digits.y == label).nonzero()[0][:3]):
            Image.fromarray(digits.x[index, 0]).save(folder / f"{i}.png")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """The docs' files, and the docs' producing commands run once each: runs, then broker files, then exports."""
    ws = Workspace(tmp_path_factory.mktemp("docs"))
    _setup_files(ws.path)
    producing = []
    for line in LINES:
        if line.synopsis or _shared_missing(line):
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                build_parser().parse_args(line.argv)
        except SystemExit:
            continue  # its own test says so
        if _kind(line.argv) == "produce":
            producing.append(line)
    for line in sorted(producing, key=lambda line: PRODUCERS.index(line.argv[0])):
        ws.run(ws.produced(line.argv))
    return ws


# ------------------------------------------------------------------ checks


def check_synopsis(line: DocLine) -> None:
    from server.strategy import STRATEGIES

    code = line.text.split(" #", 1)[0]
    command = code.split()[1]
    subcommands = _subcommands()
    assert command in subcommands, f"{line.where}: no subcommand `fedge {command}` (there are {sorted(subcommands)})"
    flags = subcommands[command]._option_string_actions
    unknown = [flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code) if flag not in flags]
    assert not unknown, f"{line.where}: `fedge {command}` has no flag {', '.join(unknown)}: {line.text}"
    for flag, listed in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)[ =]([^\s\[\]()|]+(?:\|[^\s\[\]()|]+)+)", code):
        allowed = flags[flag].choices or (list(STRATEGIES) if flag == "--strategy" else None)
        unknown = [value for value in listed.split("|") if allowed is not None and value not in allowed]
        assert not unknown, f"{line.where}: {flag} does not take {unknown} (it takes {list(allowed or [])})"


def check_parses(line: DocLine) -> None:
    argv, err, parsed = line.argv, io.StringIO(), True
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit:
        parsed = False
    assert parsed, f"{line.where}: `{line.text}` does not parse:\n{err.getvalue().strip()}"
    flags = _subcommands()[argv[0]]._option_string_actions
    prefixes = [w for w in argv if w.startswith("--") and w.split("=", 1)[0] not in flags]
    assert not prefixes, f"{line.where}: {', '.join(prefixes)}: not a flag's full name (argparse takes a prefix)"


def check_files(line: DocLine, ws: Workspace) -> None:
    argv = line.argv
    for flag, value in zip(argv, argv[1:]):
        if flag in FILE_FLAGS and value not in DOCUMENTED_ELSEWHERE:
            assert (ws.path / value).exists(), (
                f"{line.where}: {flag} {value}: no docs command or ```toml block makes it, and it is not in "
                f"DOCUMENTED_ELSEWHERE: {line.text}"
            )


@pytest.mark.parametrize("line", LINES, ids=[line.where for line in LINES])
def test_docs_command(line: DocLine, workspace: Workspace, tmp_path: Path) -> None:
    if line.synopsis:
        check_synopsis(line)
        return
    if _shared_missing(line):
        pytest.skip(f"{_shared_missing(line)} is not on this machine")
    argv = line.argv
    if not _asks_help(argv):  # (--help exits while parsing: it runs below)
        check_parses(line)
    kind = _kind(argv)
    if kind == "parse":
        check_files(line, workspace)
        return
    if kind == "produce":
        outcome = workspace.outcomes.get(tuple(workspace.produced(argv)))
        assert outcome is not None, f"{line.where}: the workspace fixture did not run `{line.text}`"
    elif argv[0] == "run" and not _asks_help(argv):
        outcome = workspace.run(workspace.small_run(argv, str(tmp_path / "run")))
    else:
        outcome = workspace.run(argv)
    assert outcome.status == 0, f"{line.where}: `{line.text}` exited {outcome.status}:\n{outcome.output[-3000:]}"


@pytest.mark.parametrize("block", TOMLS, ids=[block.where for block in TOMLS])
def test_docs_toml_is_a_run_config(block: TomlBlock, tmp_path: Path) -> None:
    shown = tmp_path / "shown.toml"
    shown.write_text(block.text)
    load_config(shown, {})  # raises ConfigError naming the bad key or value


def test_the_readme_tour_is_collected() -> None:
    readme = [line for line in LINES if line.path.name == "README.md"]
    assert {line.words[0] for line in readme} >= {"run", "export", "predict", "broker", "server", "client"}
    assert not any(line.synopsis for line in readme), "the README's tour shows concrete commands only"
