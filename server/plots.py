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
    ax.plot(
        [r + 1 for r in rounds],
        [sum(per_round[r]) / len(per_round[r]) for r in rounds],
        color="black",
        linewidth=2.5,
        label="mean",
    )
    ax.set(xlabel="round", ylabel="test accuracy (client's own test set)", title=title, ylim=(0, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_phi(phi: dict[str, float], models: dict[str, str], path: Path, title: str) -> None:
    """Bar chart of ϕ per client (pFedClub Eq. (6), the paper's Fig. 3b): teacher size change vs own model."""
    cids = list(phi)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(cids) + 2), 4))
    colors = ["tab:red" if phi[c] > 0 else "tab:blue" for c in cids]
    ax.bar(range(len(cids)), [phi[c] for c in cids], color=colors)
    ax.set_xticks(range(len(cids)), [f"{c}\n{models[c]}" for c in cids], fontsize=7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(ylabel="ϕ = mean (|w*| − |w|) / |w|", title=title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_server_time(rows: Sequence[dict[str, Any]], stages: Sequence[str], path: Path, title: str) -> None:
    """Stacked bars of the server's seconds per round, by stage (features/CKA, grouping, ... matching)."""
    per_round: dict[int, dict[str, float]] = {}
    for r in rows:
        if f"time_{stages[0]}" in r:
            per_round[r["round"]] = {s: r[f"time_{s}"] for s in stages}
    rounds = sorted(per_round)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rounds)
    for stage in stages:
        values = [per_round[r][stage] for r in rounds]
        ax.bar([r + 1 for r in rounds], values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="round", ylabel="server seconds", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
