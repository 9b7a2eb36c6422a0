"""What `fedge predict` reports of an ONNX model on labelled data: the model's provenance from its metadata (run,
client, the classes that client trained on), accuracy class by class with the confusion matrix, and a warning
when a personalized model is scored on classes its client never held (where it cannot be right)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from export import ExportError
from export.onnx import onnx_metadata
from fedge.data.own_data import DataTask, OwnDataError
from fedge.files import atomic_write

CONFUSION_PNG, PER_CLASS_JSON = "confusion.png", "per_class.json"  # what --out DIR holds
ANNOTATE_MAX_CLASSES = 20  # the confusion plot writes each cell's count up to this many classes


@dataclass(frozen=True)
class ModelInfo:
    """An ONNX file's fedge metadata: what it is (role, client, round, run) and what it expects. Fields are None
    when the file does not say (an ONNX file fedge did not write, or an export older than the field)."""

    path: Path
    meta: dict[str, str]
    classes: tuple[str, ...] | None
    input_shape: tuple[int, ...] | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    client_classes: dict[str, int] | None

    @property
    def client(self) -> str | None:
        return self.meta.get("client") or None

    def task(self, resize: bool) -> DataTask:
        """The data task the model was trained for, to read a user's own images into; ExportError when the
        file lacks the metadata that takes."""
        missing = [k for k, v in self._task_fields().items() if v is None]
        if missing:
            raise ExportError(
                f"{self.path} lacks the metadata {', '.join(missing)} that reading your own data needs (an ONNX "
                "file fedge did not export?); export the model with `fedge export`, or score it on a --dataset"
            )
        shape, classes, mean, std = self._task_fields().values()
        try:
            return DataTask(tuple(shape), classes, mean, std, owner="model", resize=resize)  # type: ignore[arg-type]
        except OwnDataError as e:
            raise ExportError(f"{self.path}: its metadata does not describe a usable task: {e}") from None

    def _task_fields(self) -> dict[str, Any]:
        return {"input_shape": self.input_shape, "class_names": self.classes, "mean": self.mean, "std": self.std}

    def describe(self) -> str:
        """One line: which model this is, of which client and run."""
        m = self.meta
        what = f"{m['role']} of client {m['client']}" if m.get("role") and m.get("client") else "a model"
        rnd = f", round {m['round']}" if m.get("round") else ""
        run = f", run {m['run']} ({m.get('strategy', '?')} on {m.get('dataset', '?')})" if m.get("run") else ""
        arch = f" {m['model']}" if m.get("model") else ""
        return f"{self.path}:{arch} {what}{rnd}{run}"

    def trained_on(self) -> str:
        """One line: the classes the model's client trained on, or why they are unknown."""
        if self.client_classes:
            held = ", ".join(f"{c} ({n:,})" for c, n in self.client_classes.items())
            return f"client {self.client} trained on classes {held} (training samples per class)"
        if self.client is None:
            return "not a client's model (no client in its metadata): no classes to compare against"
        if self.meta.get("personalized") == "false":
            return (
                f"{self.meta.get('strategy', 'its strategy')} shares models between clients (not personalized): "
                f"client {self.client}'s model learnt from the federation's data, not its client's alone"
            )
        return (
            f"client {self.client}'s training classes are not in the metadata (it read its own data, or the "
            "file was exported before fedge recorded them)"
        )


_INVALID = object()


def _prop(meta: dict[str, str], key: str, path: Path, valid: Callable[[Any], bool], what: str) -> Any:
    """The JSON metadata prop `key`, None when absent; malformed JSON, or a value `valid` refuses, raise
    ExportError saying what it should be."""
    if not meta.get(key):
        return None
    try:
        value = json.loads(meta[key])
    except json.JSONDecodeError:
        value = _INVALID
    if value is _INVALID or not valid(value):
        raise ExportError(f"{path}: its metadata {key!r} should be {what}, got {meta[key][:80]!r}")
    return value


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def _counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v.values())


def model_info(path: str | Path) -> ModelInfo:
    """The fedge metadata of the ONNX file at `path`; a missing or unreadable file or malformed metadata raise
    ExportError."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(
            f"{path} does not exist; give an ONNX file of `fedge export` or a run's models/<client>/*.onnx"
        )
    meta = onnx_metadata(path)
    shape = meta.get("input_shape")
    try:
        input_shape = tuple(int(d) for d in shape.split("x")) if shape else None
    except ValueError:
        raise ExportError(f"{path}: its metadata 'input_shape' should be C x H x W, got {shape!r}") from None
    classes = _prop(meta, "class_names", path, _strings, "a JSON list of class names")
    mean, std = (_prop(meta, k, path, _numbers, "a JSON list of numbers, one per channel") for k in ("mean", "std"))
    held = _prop(meta, "client_classes", path, _counts, "a JSON object of class name: training samples")
    return ModelInfo(
        path,
        meta,
        None if classes is None else tuple(classes),
        input_shape,
        None if mean is None else tuple(map(float, mean)),
        None if std is None else tuple(map(float, std)),
        held,
    )


@dataclass(frozen=True)
class Scores:
    """A model's predictions against the labels: the confusion matrix (row: true class, column: predicted)."""

    classes: tuple[str, ...]
    confusion: np.ndarray  # (C, C) int64

    @property
    def total(self) -> int:
        return int(self.confusion.sum())

    @property
    def correct(self) -> int:
        return int(np.trace(self.confusion))

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    def per_class(self, held: dict[str, int] | None) -> list[dict[str, Any]]:
        """One row per class: its label, name, samples, correct, accuracy (None without samples) and, when the
        client's classes are known, whether its client held the class."""
        rows = []
        for label, name in enumerate(self.classes):
            n, k = int(self.confusion[label].sum()), int(self.confusion[label, label])
            row = {"label": label, "class": name, "samples": n, "correct": k, "accuracy": k / n if n else None}
            rows.append(row | ({"held_by_client": name in held} if held else {}))
        return rows

    def subset(self, names: set[str]) -> tuple[int, int]:
        """(correct, samples) over the classes in `names`."""
        labels = [i for i, c in enumerate(self.classes) if c in names]
        return int(self.confusion[labels, labels].sum()), int(self.confusion[labels].sum())


def score(logits: np.ndarray, y: np.ndarray, classes: tuple[str, ...]) -> Scores:
    """The confusion matrix of argmax(logits) against labels `y` (at least one) over `classes`."""
    k = len(classes)
    pred = np.asarray(logits).argmax(1)
    confusion = np.bincount(np.asarray(y) * k + pred, minlength=k * k).reshape(k, k).astype(np.int64)
    return Scores(classes, confusion)


def unheld_warning(scores: Scores, info: ModelInfo) -> str | None:
    """One line when some samples are of classes the model's client never held (a personalized model cannot
    be judged on those); None when all are of its classes, or its classes are unknown."""
    if not info.client_classes:
        return None
    held = set(info.client_classes)
    never = [r["class"] for r in scores.per_class(None) if r["samples"] and r["class"] not in held]
    if not never:
        return None
    own_correct, own = scores.subset(held)
    own_acc = f"{own_correct / own:.4f} ({own_correct}/{own})" if own else "not measured (no sample of them here)"
    return (
        f"warning: client {info.client} never held classes {', '.join(never)}, yet "
        f"{scores.total - own} of these {scores.total} samples are of them; a personalized model is not meant "
        f"to know them. On its own classes ({', '.join(info.client_classes)}) the accuracy is {own_acc}"
    )


def table(scores: Scores, held: dict[str, int] | None) -> str:
    """The per-class table as printed: class, samples, correct, accuracy (and held, when known) of each class
    with samples, the total, and the classes without samples on one line."""
    width = max(5, *(len(c) for c in scores.classes))
    head = f"{'class':<{width}} {'samples':>8} {'correct':>8} {'accuracy':>9}" + ("  held" if held else "")
    lines, absent = [head], []
    for r in scores.per_class(held):
        if not r["samples"]:
            absent.append(r["class"])
            continue
        mark = ("  yes" if r["held_by_client"] else "  no") if held else ""
        lines.append(f"{r['class']:<{width}} {r['samples']:>8,} {r['correct']:>8,} {r['accuracy']:>9.4f}{mark}")
    lines.append(f"{'all':<{width}} {scores.total:>8,} {scores.correct:>8,} {scores.accuracy:>9.4f}")
    return "\n".join(lines + ([f"no samples of classes {', '.join(absent)}"] if absent else []))


def write_report(
    out: str | Path, info: ModelInfo, scores: Scores, data: dict[str, Any], warning: str | None
) -> tuple[Path, Path]:
    """--out DIR: per_class.json (the model's metadata, what it was scored on, the per-class table, the
    confusion matrix and unheld_warning's `warning`, if any) and confusion.png. Needs matplotlib (the server
    extra)."""
    from fedge.extras import require

    require("matplotlib", what="fedge predict --out (the confusion matrix plot)")
    out = Path(out)
    keys = ("model", "role", "client", "round", "run", "run_id", "strategy", "dataset")
    doc = {
        "model": str(info.path),
        "metadata": {k: info.meta[k] for k in keys if info.meta.get(k)} | {"client_classes": info.client_classes},
        "data": data,
        "total": scores.total,
        "correct": scores.correct,
        "accuracy": scores.accuracy,
        "per_class": scores.per_class(info.client_classes),
        "confusion": scores.confusion.tolist(),
        "confusion_axes": "rows: true class, columns: predicted class, in per_class order",
        "warning": warning,
    }
    report = out / PER_CLASS_JSON
    atomic_write(report, (json.dumps(doc, indent=2) + "\n").encode(), mode=0o644)
    png = out / CONFUSION_PNG
    _plot_confusion(scores, png, f"{info.meta.get('model', info.path.name)} on {data['where']}")
    return report, png


def _plot_confusion(scores: Scores, path: Path, title: str) -> None:
    """The confusion matrix coloured by the share of each true class (row), annotated with the counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(scores.classes)
    rows = scores.confusion.sum(1, keepdims=True)
    share = np.divide(scores.confusion, rows, out=np.zeros(scores.confusion.shape), where=rows > 0)
    size = min(4 + 0.45 * k, 14)
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    ax.set_xticks(range(k), scores.classes, rotation=90 if k > 10 else 0)
    ax.set_yticks(range(k), scores.classes)
    if k <= ANNOTATE_MAX_CLASSES:
        for i in range(k):
            for j in range(k):
                if scores.confusion[i, j]:
                    color = "white" if share[i, j] > 0.5 else "black"
                    ax.text(j, i, str(scores.confusion[i, j]), ha="center", va="center", fontsize=7, color=color)
    title = f"{title}\naccuracy {scores.accuracy:.4f} on {scores.total:,}"
    ax.set(xlabel="predicted class", ylabel="true class", title=title)
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
