"""bench/reproduce.py's report: each run's accuracy and ϕ read from its folder, cells over seeds, the direction
checks against the paper's, and the Markdown tables and results.json."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.paired import Paired, paired
from bench.reproduce_paper import MOBILENETS, PAPER_FIG3_SIZE, Cell, paper_mean, paper_value

ONE_POINT = 1.0  # pFedClub+ within about a point (percentage point) of pFedClub
LAST_ROUNDS = 3  # the authors' "last 3 avg local acc" (original-code-notes §1.2)
HOLDS, FAILS, NOISE, NA = "✓", "✗", "≈", "n/a"
Verdict = bool | str | None  # True holds, False does not, NOISE: the per-seed differences' signs differ, None: n/a


@dataclass(frozen=True)
class ClientResult:
    """One client of one run."""

    model: str
    final: float | None  # accuracy %, at the end
    last3: float | None  # accuracy %, mean over the last rounds it was evaluated in
    phi: float | None  # Eq. (6): mean over the rounds it got a teacher
    phi_max: float | None  # largest per-round ϕ


@dataclass(frozen=True)
class SeedResult:
    """One finished run: mean client accuracy (%) at the end and over the last rounds, and per client."""

    final: float | None
    last3: float | None
    clients: Mapping[str, ClientResult] = field(default_factory=dict)
    own_share: float | None = None  # pFedClub: the kept candidates' own-block share, mean over clients
    self_rounds: int | None = None  # reassembly: rounds whose teacher was the client's own model, over all clients


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def read_run(folder: Path) -> SeedResult:
    """A finished run's accuracies from its folder: summary.json's final mean (every client that took part, its
    own model on its own test set, after the last round) and metrics.jsonl's last rounds (per round, the mean over
    the clients that trained in it, evaluated right after that training, as the authors' code; then averaged)."""
    summary = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    return seed_result(summary, rows)


def seed_result(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> SeedResult:
    """SeedResult from a summary.json and metrics.jsonl rows (see read_run)."""
    evaluated = [r for r in rows if r.get("trained") and r.get("accuracy") is not None]
    last = sorted({r["round"] for r in evaluated})[-LAST_ROUNDS:]
    per_round = [_mean([100 * r["accuracy"] for r in evaluated if r["round"] == rnd]) for rnd in last]
    final = summary["final_accuracy"]
    clients = {}
    for cid, model in summary["models"].items():
        mine = [r for r in evaluated if r["client"] == cid]
        mine_last = [100 * r["accuracy"] for r in mine[-LAST_ROUNDS:]]  # rows come in round order
        phis = [r["phi"] for r in rows if r["client"] == cid and r.get("phi") is not None]
        acc = final["per_client"].get(cid)
        clients[cid] = ClientResult(
            model,
            None if acc is None else 100 * acc,
            _mean(mine_last),
            summary.get("phi", {}).get(cid),
            max(phis) if phis else None,
        )
    shares = [v for v in summary.get("own_block_share", {}).values() if v is not None]
    selfs = summary.get("teacher_is_self_rounds")
    return SeedResult(
        None if final["mean"] is None else 100 * final["mean"],
        _mean(per_round),
        clients,
        _mean(shares),
        None if selfs is None else sum(selfs.values()),
    )


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value) of the non-missing values; (None, None) if none."""
    kept = [v for v in values if v is not None]
    if not kept:
        return None, None
    return statistics.fmean(kept), statistics.stdev(kept) if len(kept) > 1 else 0.0


def fmt(mean: float | None, std: float | None = None, digits: int = 2) -> str:
    if mean is None:
        return NA
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f}±{std:.{digits}f}"


def holds(ok: Verdict) -> str:
    return NA if ok is None else NOISE if ok == NOISE else HOLDS if ok else FAILS


def at_least(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a >= b


@dataclass
class CellStats:
    """A cell over its seeds."""

    cell: Cell
    seeds: list[int]
    results: list[SeedResult]

    def stat(self, metric: str) -> tuple[float | None, float | None]:
        return mean_std([getattr(r, metric) for r in self.results])

    def mean(self, metric: str) -> float | None:
        return self.stat(metric)[0]

    def by_model(self) -> dict[str, dict[str, Any]]:
        """Per model type (over its clients and the seeds): accuracy, ϕ and the largest per-round ϕ."""
        out: dict[str, dict[str, list[float]]] = {}
        for r in self.results:
            for c in r.clients.values():
                slot = out.setdefault(c.model, {"final": [], "last3": [], "phi": [], "phi_max": []})
                for key in slot:
                    if getattr(c, key) is not None:
                        slot[key].append(getattr(c, key))
        return {
            m: {
                "final": mean_std(v["final"]),
                "last3": mean_std(v["last3"]),
                "phi": mean_std(v["phi"]),
                "phi_max": max(v["phi_max"]) if v["phi_max"] else None,
            }
            for m, v in out.items()
        }

    def phi_max(self) -> float | None:
        values = [c.phi_max for r in self.results for c in r.clients.values() if c.phi_max is not None]
        return max(values) if values else None


@dataclass(frozen=True)
class Check:
    """A direction the paper shows, and whether it holds: ours on the final and the last-rounds accuracy, and the
    paper's own numbers (None: not applicable or not known)."""

    claim: str
    final: Verdict
    last3: Verdict
    paper: bool | None

    def ours(self) -> str:
        return f"{holds(self.final)} {holds(self.last3)}"


def _within(a: float | None, b: float | None, bound: float = ONE_POINT) -> bool | None:
    return None if a is None or b is None else abs(a - b) <= bound


def _both(a: bool | None, b: bool | None) -> bool | None:
    return None if a is None or b is None else a and b


def _compare(a: CellStats | None, b: CellStats | None, test: Any) -> tuple[bool | None, bool | None]:
    """test(a, b) on the final and on the last-rounds mean accuracy; None where a cell is missing."""
    final, last3 = (test(a and a.mean(m), b and b.mean(m)) for m in ("final", "last3"))
    return final, last3


def _by_seed(a: CellStats | None, b: CellStats | None) -> tuple[list[int], dict[str, Paired]]:
    """The seeds both cells ran and, per metric (final, last3), a − b on them (bench/paired.py); no seeds where a
    cell is missing."""
    if a is None or b is None:
        return [], {}
    mine, theirs = dict(zip(a.seeds, a.results)), dict(zip(b.seeds, b.results))
    seeds = sorted(set(mine) & set(theirs))
    if not seeds:
        return [], {}
    return seeds, {
        m: paired([getattr(mine[s], m) for s in seeds], [getattr(theirs[s], m) for s in seeds])
        for m in ("final", "last3")
    }


def _verdict(p: Paired) -> Verdict:
    """True / False when every seed agrees on the sign, NOISE otherwise, None with no seed to compare."""
    return None if not p.diffs else {1: True, -1: False, 0: NOISE}[p.sign]


def _paired(a: CellStats | None, b: CellStats | None) -> tuple[Verdict, Verdict]:
    """ "a above b" on the final and on the last-rounds accuracy, from the per-seed paired differences over the
    seeds both cells ran: True / False when every seed agrees, NOISE otherwise, None where a cell is missing."""
    _, diffs = _by_seed(a, b)
    return (_verdict(diffs["final"]), _verdict(diffs["last3"])) if diffs else (None, None)


def compared(cell: Cell) -> list[tuple[str, Cell, Cell]]:
    """The paired comparisons this row takes part in, each (claim, a, b) for "a above b": pFedClub ≥ pFedHR
    (Table 1, Fig. 3), full pFedClub ≥ each ablation (Table 3), and every federated row against training alone."""
    pairs = []
    if cell.strategy == "pfedclub" and cell.variant == "none" and cell.preset in ("table1", "fig3"):
        pairs.append(("≥ pFedHR", cell, replace(cell, strategy="pfedhr")))
    if cell.preset == "table3" and cell.strategy == "pfedclub" and cell.variant != "none":
        pairs.append(("full ≥ this", replace(cell, variant="none"), cell))
    if cell.strategy != "local":
        pairs.append(("> local", cell, replace(cell, strategy="local", public="-", variant="none", eta=None)))
    return pairs


def direction(cell: Cell, stats: Mapping[Cell, CellStats]) -> Check | None:
    """The paper's direction for this row: pFedClub ≥ pFedHR (Table 1, Fig. 3); full pFedClub ≥ each ablation
    (Table 3), both on the per-seed paired differences; pFedClub+ teachers never above 1+η (max per-round ϕ ≤ η)
    and within ONE_POINT of pFedClub on the means (Fig. 3). None for a row the paper states nothing about."""
    me, paper = stats.get(cell), paper_mean(paper_value(cell))
    for claim, a, b in compared(cell):
        if claim != "> local":
            final, last3 = _paired(stats.get(a), stats.get(b))
            return Check(claim, final, last3, at_least(paper_mean(paper_value(a)), paper_mean(paper_value(b))))
    if cell.strategy == "pfedclub+" and cell.eta is not None:
        club = replace(cell, strategy="pfedclub", eta=None)
        phi_max = me.phi_max() if me else None
        bound = None if phi_max is None else phi_max <= cell.eta
        final, last3 = _compare(me, stats.get(club), _within)
        # the paper (§4.4): pFedClub+ gives every client ϕ ≤ 0, below the bound η = 0.1
        return Check(
            f"max ϕ ≤ η, within {ONE_POINT:g} pt of pFedClub",
            _both(bound, final),
            _both(bound, last3),
            _within(paper, paper_mean(paper_value(club))),
        )
    return None


def beats_local(cell: Cell, stats: Mapping[Cell, CellStats]) -> Check | None:
    """Federation beats training alone: this cell's accuracy above local's on the same data, fleet and seeds,
    on the per-seed paired differences."""
    for claim, a, b in compared(cell):
        if claim == "> local":
            return Check(claim, *_paired(stats.get(a), stats.get(b)), None)
    return None


def teacher_rows(cells: Sequence[CellStats]) -> list[list[str]]:
    """Per reassembly row (pFedHR, pFedClub and its variants): the kept candidates' own-block share (pFedClub) and
    the rounds whose teacher was the client's own model, beside the final accuracy; mean±std over seeds."""
    rows = []
    for cs in cells:
        selfs = [r.self_rounds for r in cs.results]
        if all(v is None for v in selfs):
            continue
        c = cs.cell
        rows.append(
            [
                c.dataset,
                _fleet(c),
                c.partition,
                c.public,
                c.method,
                fmt(*cs.stat("final")),
                fmt(*mean_std([r.own_share for r in cs.results]), digits=3),
                fmt(*mean_std([None if v is None else float(v) for v in selfs]), digits=1),
            ]
        )
    return rows


def difference_lines(cells: Sequence[CellStats], stats: Mapping[Cell, CellStats]) -> list[str]:
    """Per compared pair of rows whose cells both ran: a − b per seed (final, last-rounds) and the verdict."""
    lines = []
    for cs in cells:
        for claim, a, b in compared(cs.cell):
            seeds, diffs = _by_seed(stats.get(a), stats.get(b))
            if not seeds:
                continue
            where = f"{a.dataset} {_fleet(a)} {a.partition}" + ("" if a.public == "-" else f" {a.public}")
            shown = [
                f"{label} {diffs[m].text()} {holds(_verdict(diffs[m]))}"
                for m, label in (("final", "final"), ("last3", f"last-{LAST_ROUNDS}"))
                if diffs[m].diffs
            ]
            lines.append(f"- {where}: {a.method} − {b.method} ({claim}), seeds {seeds}: {'; '.join(shown)}")
    return lines


TITLES = {
    "table1": "Table 1: heterogeneous zoos, labeled and unlabeled public data",
    "table3": "Table 3: ablations (Zoo III, unlabeled public data)",
    "fig3": "Fig. 3: controllability (one client per model type, all active; the paper's dataset is SVHN)",
}
LEGEND = (
    f"final: mean client accuracy (%) after the last round over every client that took part (its own model on "
    f"its own test set); last-{LAST_ROUNDS}: per round the mean over the clients trained in it, evaluated right after "
    f"local training (the authors' code), averaged over the last {LAST_ROUNDS} rounds (all, if fewer); mean±std over "
    f"seeds. "
    f"Checks, on final then last-{LAST_ROUNDS}, from the per-seed paired differences (same seeds, same splits): "
    f"{HOLDS} holds in every seed / {FAILS} fails in every seed / {NOISE} within noise (the seeds disagree, or one "
    f"seed) / {NA}; \"paper's\" applies the same direction to the paper's means."
)
COLUMNS = ("dataset", "fleet", "partition", "public", "method", "final", f"last-{LAST_ROUNDS}", "paper")
CHECK_COLUMNS = ("direction", "ours", "paper's", "> local")


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _fleet(cell: Cell) -> str:
    return f"{cell.zoo}, one per model" if cell.one_per_model else cell.zoo


def row(cs: CellStats, stats: Mapping[Cell, CellStats]) -> list[str]:
    """One Markdown row: the cell, our accuracies, the paper's number, the direction checks."""
    cell, paper = cs.cell, paper_value(cs.cell)
    check, local = direction(cell, stats), beats_local(cell, stats)
    paper_text = NA if paper is None else paper + (" (SVHN)" if cell.preset == "fig3" else "")
    return [
        cell.dataset,
        _fleet(cell),
        cell.partition,
        cell.public,
        cell.method,
        fmt(*cs.stat("final")),
        fmt(*cs.stat("last3")),
        paper_text,
        check.claim if check else "",
        check.ours() if check else "",
        holds(check.paper) if check else "",
        local.ours() if local else "reference",
    ]


def model_rows(cs: CellStats) -> list[list[str]]:
    """Fig. 3 per model type: accuracy, ϕ (Eq. 6), teacher size over own, the largest per-round ϕ, the paper."""
    rows = []
    for model, m in sorted(cs.by_model().items()):
        phi = m["phi"][0]
        rows.append(
            [
                cs.cell.dataset,
                cs.cell.method,
                model,
                fmt(*m["final"]),
                fmt(*m["last3"]),
                fmt(*m["phi"], digits=3),
                NA if phi is None else f"{1 + phi:.2f}x",
                fmt(m["phi_max"], digits=3),
                PAPER_FIG3_SIZE.get((cs.cell.strategy, model), "ϕ≤0" if cs.cell.strategy == "pfedclub+" else ""),
            ]
        )
    return rows


def size_lines(cells: Sequence[CellStats]) -> list[str]:
    """Fig. 3(b)'s directions per fleet, on mean ϕ per model type: CNN1's teachers larger under pFedHR than under
    pFedClub (paper: ≈4.8x vs ≈1.5x), MobileNets' ϕ < 0 under pFedClub, every ϕ ≤ 0 under pFedClub+."""
    groups: dict[tuple[str, ...], dict[str, dict[str, Any]]] = {}
    for cs in cells:
        c = cs.cell
        groups.setdefault((c.dataset, c.zoo, c.partition, c.public), {})[c.strategy] = cs.by_model()
    lines = []
    for (dataset, zoo, partition, public), by in groups.items():
        if public == "-":
            continue

        def phi(strategy: str, model: str) -> float | None:
            return by.get(strategy, {}).get(model, {}).get("phi", (None, None))[0]

        where = f"{dataset} zoo {zoo} {partition} {public}"
        hr, club = phi("pfedhr", "cnn1"), phi("pfedclub", "cnn1")
        if hr is not None or club is not None:
            sizes = (
                f"pFedHR {fmt(None if hr is None else 1 + hr)}x, pFedClub {fmt(None if club is None else 1 + club)}x"
            )
            lines.append(f"- {where}: CNN1's teacher/own, {sizes}: pFedHR larger {holds(at_least(hr, club))} "
                         f"(paper (SVHN): ≈4.8x vs ≈1.5x {HOLDS})")  # fmt: skip
        mobile = {m: phi("pfedclub", m) for m in MOBILENETS if phi("pfedclub", m) is not None}
        if mobile:
            ok = all(v < 0 for v in mobile.values())
            shown = ", ".join(f"{m} {v:+.3f}" for m, v in mobile.items())
            lines.append(f"- {where}: pFedClub ϕ < 0 for MobileNets ({shown}): {holds(ok)} (paper (SVHN): {HOLDS})")
        plus = [v["phi"][0] for v in by.get("pfedclub+", {}).values() if v["phi"][0] is not None]
        if plus:
            lines.append(f"- {where}: pFedClub+ ϕ ≤ 0 for every model type (largest {max(plus):+.3f}): "
                         f"{holds(max(plus) <= 0)} (paper (SVHN): {HOLDS})")  # fmt: skip
    return lines


def render(stats: Mapping[Cell, CellStats], header: Sequence[str]) -> str:
    """The whole report: header lines, then one table per preset (Fig. 3 also per model type)."""
    lines = list(header) + ["", LEGEND]
    for preset in dict.fromkeys(c.preset for c in stats):
        cells = [cs for c, cs in stats.items() if c.preset == preset]
        lines += ["", f"## {TITLES.get(preset, preset)}", ""]
        lines += _md(COLUMNS + CHECK_COLUMNS, [row(cs, stats) for cs in cells])
        differences = difference_lines(cells, stats)
        lines += ["", "Paired differences, seed by seed:", "", *differences] if differences else []
        teachers = teacher_rows(cells)
        if teachers:
            lines += [
                "",
                "Teachers (own-block share: of the kept candidates' blocks, the client's own, pFedClub; "
                "self rounds: rounds whose teacher was the client's own model, summed over clients):",
                "",
            ]
            header_t = ("dataset", "fleet", "partition", "public", "method", "final", "own-block share", "self rounds")
            lines += _md(header_t, teachers)
        if preset == "fig3":
            lines += ["", "Per model type (ϕ: pFedClub Eq. (6), mean over the rounds a client got a teacher):", ""]
            header_m = ("dataset", "method", "model", "final", f"last-{LAST_ROUNDS}", "ϕ", "teacher/own")
            rows = [r for cs in cells if cs.cell.strategy != "local" for r in model_rows(cs)]
            lines += _md(header_m + ("max round ϕ", "paper (SVHN)"), rows)
            sizes = size_lines(cells)
            lines += ["", "Teacher size directions (Fig. 3(b), mean ϕ per model type):", ""] + sizes if sizes else []
    return "\n".join(lines) + "\n"


def _check_json(check: Check | None) -> dict[str, Any] | None:
    return (
        None
        if check is None
        else {"claim": check.claim, "final": check.final, "last3": check.last3, "paper": check.paper}
    )


def to_json(stats: Mapping[Cell, CellStats]) -> list[dict[str, Any]]:
    """Every cell for results.json: its keys, per-seed and mean±std accuracies, the paper's number, the checks."""
    out = []
    for cell, cs in stats.items():
        out.append(
            {
                "preset": cell.preset,
                "dataset": cell.dataset,
                "zoo": cell.zoo,
                "one_per_model": cell.one_per_model,
                "partition": cell.partition,
                "public": cell.public,
                "strategy": cell.strategy,
                "variant": cell.variant,
                "eta": cell.eta,
                "method": cell.method,
                "seeds": cs.seeds,
                "final": [r.final for r in cs.results],
                "last3": [r.last3 for r in cs.results],
                "own_block_share": [r.own_share for r in cs.results],
                "teacher_is_self_rounds": [r.self_rounds for r in cs.results],
                "final_mean_std": cs.stat("final"),
                "last3_mean_std": cs.stat("last3"),
                "paper": paper_value(cell),
                "direction": _check_json(direction(cell, stats)),
                "beats_local": _check_json(beats_local(cell, stats)),
                "by_model": cs.by_model() if cell.one_per_model else None,
            }
        )
    return out
