"""The run folder: resolved config, metrics.jsonl (one line per round and client), the server checkpoint,
summary.json, plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedge.checkpoint import Tree, load_tree, save_tree
from fedge.files import atomic_write

CHECKPOINT_FILE = "checkpoint.safetensors"  # the server's state after the last completed round


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as null so every line parses everywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RunLog:
    """Writes one run's folder; metrics lines are appended and flushed as rounds finish.

    A new run needs a folder without a run in it (else FileExistsError). With `resume`, the folder must
    hold a checkpoint (else FileNotFoundError); its metrics lines are kept and appended to.
    """

    def __init__(self, out: Path, config: Mapping[str, Any], resume: bool = False) -> None:
        self.out = Path(out)
        self.metrics_path = self.out / "metrics.jsonl"
        self.checkpoint_path = self.out / CHECKPOINT_FILE
        if resume and not self.checkpoint_path.exists():
            raise FileNotFoundError(
                f"run folder {self.out} has no {CHECKPOINT_FILE} to resume from; check --out, or start a new run"
            )
        if not resume and self.metrics_path.exists():
            raise FileExistsError(
                f"run folder {self.out} already holds a run; choose another --out, delete it, or resume it"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        self.write_json("config.json", config)
        if not resume:
            self.metrics_path.write_text("")

    def write_json(self, name: str, data: Mapping[str, Any]) -> None:
        """Write one JSON file of the run folder atomically (NaN/Inf become null)."""
        text = json.dumps(_clean(data), indent=2, sort_keys=True, default=_json_default)
        atomic_write(self.out / name, (text + "\n").encode())

    def append_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append metrics lines, one JSON object each."""
        with self.metrics_path.open("a") as f:
            for row in rows:
                f.write(json.dumps(_clean(dict(row)), sort_keys=True, default=_json_default) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        """Every metrics line written so far."""
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def write_checkpoint(self, tree: Tree) -> None:
        """Replace the run's checkpoint atomically (see fedge.checkpoint.save_tree)."""
        save_tree(self.checkpoint_path, tree)

    def read_checkpoint(self) -> Tree:
        """The run's checkpoint; a missing or corrupt one raises CheckpointError."""
        return load_tree(self.checkpoint_path)

    def keep_rounds_before(self, rnd: int) -> None:
        """On resume: drop the metrics lines of rounds >= rnd, which the interrupted run wrote after its last
        checkpoint, and a torn last line (which can only be one of those)."""
        lines = self.metrics_path.read_text().splitlines() if self.metrics_path.exists() else []
        kept = [line for line in lines if (r := _line_round(line)) is not None and r < rnd]
        atomic_write(self.metrics_path, "".join(line + "\n" for line in kept).encode())


def _line_round(line: str) -> int | None:
    """The round of one metrics line; None for a line that does not parse."""
    try:
        return int(json.loads(line)["round"])
    except (ValueError, KeyError, TypeError):
        return None
