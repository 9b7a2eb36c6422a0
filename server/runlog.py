"""The run folder: resolved config, metrics.jsonl (one line per round and client), summary.json, plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedge.weights import atomic_write


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
    """Writes one run's folder; metrics lines are appended and flushed as rounds finish."""

    def __init__(self, out: Path, config: Mapping[str, Any]) -> None:
        self.out = Path(out)
        if (self.out / "metrics.jsonl").exists():
            raise FileExistsError(f"run folder {self.out} already holds a run; choose another --out or delete it")
        self.out.mkdir(parents=True, exist_ok=True)
        self.write_json("config.json", config)
        self.metrics_path = self.out / "metrics.jsonl"
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
