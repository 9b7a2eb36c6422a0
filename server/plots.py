"""PNG plots of a run, drawn from its metrics rows (matplotlib, no display needed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def plot_accuracy(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Accuracy per round: one thin line per client (rounds it was evaluated) and the mean in bold."""
    per_client: dict[str, list[tuple[int, float]]] = defaultdict(list)
    per_round: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r.get("accuracy") is not None:
            per_client[r["client"]].append((r["round"], r["accuracy"]))
            per_round[r["round"]].append(r["accuracy"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cid, points in sorted(per_client.items()):
        xs, ys = zip(*points)
        ax.plot([x + 1 for x in xs], ys, marker=".", linewidth=0.8, alpha=0.5, label=f"client {cid}")
    rounds = sorted(per_round)
    ax.plot([r + 1 for r in rounds], [sum(per_round[r]) / len(per_round[r]) for r in rounds],
            color="black", linewidth=2.5, label="mean")
    ax.set(xlabel="round", ylabel="test accuracy (client's own test set)", title=title, ylim=(0, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
