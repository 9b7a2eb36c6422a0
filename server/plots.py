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


SECONDS_UNITS = ((3600.0, "h"), (60.0, "min"), (1.0, "s"))  # the largest unit the run reaches twice over
MACS_UNITS = ((1e15, "PMACs"), (1e12, "TMACs"), (1e9, "GMACs"), (1e6, "MMACs"), (1.0, "MACs"))


def _unit(largest: float, units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The biggest (scale, name) of `units` that `largest` reaches at least twice, else the smallest."""
    return next(((scale, name) for scale, name in units if largest >= 2 * scale), units[-1])


def time_to_accuracy_points(rows: Sequence[dict[str, Any]]) -> list[tuple[float, int, float]]:
    """(cumulative simulated seconds, cumulative training MACs, mean client accuracy) per round that was
    evaluated and carries the simulated clock, in round order."""
    per_round: dict[int, list[float]] = defaultdict(list)
    clock: dict[int, tuple[float, int]] = {}
    for r in rows:
        if r.get("cumulative_sim_seconds") is not None and r.get("cumulative_train_macs") is not None:
            clock[r["round"]] = (r["cumulative_sim_seconds"], r["cumulative_train_macs"])
        if r.get("accuracy") is not None:
            per_round[r["round"]].append(r["accuracy"])
    return [(*clock[rnd], sum(accs) / len(accs)) for rnd, accs in sorted(per_round.items()) if rnd in clock]


def plot_time_to_accuracy(runs: dict[str, Sequence[dict[str, Any]]], path: Path, title: str) -> None:
    """Two panels, one line per run (label → its metrics rows): mean client accuracy per round against the
    cumulative simulated time and against the cumulative training MACs (FedScale's time-to-accuracy view).
    Rows without the simulated clock (runs from before it) are left out."""
    points = {label: time_to_accuracy_points(rows) for label, rows in runs.items()}
    seconds, sec_name = _unit(max((p[0] for ps in points.values() for p in ps), default=0.0), SECONDS_UNITS)
    macs, macs_name = _unit(max((p[1] for ps in points.values() for p in ps), default=0), MACS_UNITS)
    fig, (by_time, by_macs) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for label, ps in points.items():
        if ps:
            by_time.plot([p[0] / seconds for p in ps], [p[2] for p in ps], marker=".", label=label)
            by_macs.plot([p[1] / macs for p in ps], [p[2] for p in ps], marker=".", label=label)
    by_time.set(xlabel=f"simulated time ({sec_name})", ylabel="mean test accuracy (clients evaluated)", ylim=(0, 1))
    by_macs.set(xlabel=f"total training compute ({macs_name})")
    for ax in (by_time, by_macs):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
