"""What each aggregator costs an honest fleet and what it saves under attack (issue 28): for every strategy that
averages and every aggregator (`--aggregator`), the honest clients' final accuracy of an all-honest run beside a run
where one client lies within the bounds (same seed, same fleet), and the server's aggregation time of each.

    python bench/robust.py                                     # fedavg, fedmn, heterofl; every aggregator; 2 seeds
    python bench/robust.py --strategies fedavg --seeds 0 --rounds 3

The liar (client 0 unless --liar) has its true registration and answers every task; what it uploads (--attack) is
-9.9 x what the task sent it (inside the 10 x norm bound), or its honest update reversed and x 8 (inside the 10 x
median update bound, so it is clipped rather than refused), and for FedMN every path of its next and most likely
route on. Accuracy is the mean final accuracy of the other clients; "paired" is attacked - honest per seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from fedge import constants as C  # noqa: E402
from fedge.brokers.transport import Handler  # noqa: E402
from fedge.config import RunConfig, config_from  # noqa: E402
from fedge.wire.messages import Result, Task, Weights  # noqa: E402
from launch.simulation import run_simulation  # noqa: E402
from methods.fedmn.modular import NEXT_ROUTE, ROUTING  # noqa: E402

FLEETS: dict[str, dict[str, Any]] = {  # strategy -> the run keys of its fleet
    "fedavg": {"zoo": "cnn1"},
    "heterofl": {"zoo": "cnn2,cnn1"},
    "fedmn": {"zoo": "fedmn_2x2_cnn1"},
}
Lie = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (sent, honestly trained) -> what the liar uploads
# name -> (what one tensor becomes, the help line): inside today's checks, each in its own way
ATTACKS: dict[str, tuple[Lie, str]] = {
    "scaled": (lambda sent, mine: sent * -9.9, "-9.9 x what it was sent (inside the 10 x norm bound)"),
    "flipped": (
        lambda sent, mine: sent - 8 * (mine - sent),
        "its honest update reversed and x 8 (inside the 10 x median update bound)",
    ),
}


def liar(attack: str) -> Callable[[Handler], Handler]:
    """An adversary for run_simulation: the client trains honestly (its metrics and example count stay true), then
    uploads ATTACKS[attack] of every model (same architecture) and named tensor that its task sent; FedMN's next
    and most likely routes turn every path on."""
    lie = ATTACKS[attack][0]

    def wrap(honest: Handler) -> Handler:
        def lying(task: Task) -> Result:
            res = honest(task)
            if res.error is not None or task.type in ("evaluate", "modular_evaluate"):
                return res
            sent = {m.spec.with_origin(None).to_json(): m for m in task.models.values()}
            models = {}
            for role, w in res.models.items():
                ref = sent.get(w.spec.with_origin(None).to_json())
                models[role] = w if ref is None else Weights(w.spec, lied(ref.state, w.state, lie))
            tensors = lied(task.tensors, res.tensors, lie)
            for name in (NEXT_ROUTE, ROUTING):
                if name in tensors:
                    tensors[name] = torch.ones_like(tensors[name])
            return dataclasses.replace(res, models=models, tensors=tensors)

        return lying

    return wrap


def lied(sent: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], lie: Lie) -> dict[str, torch.Tensor]:
    """`mine` with every floating tensor that `sent` also holds (same shape) replaced by lie(sent, mine)."""
    out = dict(mine)
    for name, t in mine.items():
        if t.is_floating_point() and name in sent and sent[name].shape == t.shape:
            out[name] = lie(sent[name].double(), t.double()).to(t.dtype)
    return out


def config(args: argparse.Namespace, strategy: str, aggregator: str, seed: int, out: Path) -> RunConfig:
    """One small in-process run of `strategy` with `aggregator`."""
    values = {
        "strategy": strategy,
        "dataset": args.dataset,
        "clients": args.clients,
        "active": args.clients,
        "rounds": args.rounds,
        "local_epochs": args.local_epochs,
        "max_samples_per_client": args.samples,
        "seed": seed,
        "aggregator": aggregator,
        "device": "cpu",
        "export_onnx": False,
        "out": str(out),
    } | FLEETS[strategy]
    return config_from(values)


def one_run(cfg: RunConfig, liar_id: str, attack: str | None) -> dict[str, Any]:
    """The mean final accuracy of the clients other than `liar_id` and the server's seconds of one run, where
    `liar_id` runs `attack` (None: it is honest)."""
    start = time.perf_counter()
    summary = run_simulation(cfg, progress=False, adversaries={liar_id: liar(attack)} if attack else None)
    honest = {cid: a for cid, a in summary["final_accuracy"]["per_client"].items() if cid != liar_id}
    return {
        "accuracy": statistics.fmean(honest.values()) if honest else float("nan"),
        "server_s": sum(summary["server_seconds"]),
        "wall_s": time.perf_counter() - start,
        "rejected": summary["rejected_replies"],
        "clipped": sum(summary["clipped_updates"].values()),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", nargs="+", default=list(FLEETS), choices=list(FLEETS))
    p.add_argument("--aggregators", nargs="+", default=list(C.AGGREGATORS), choices=list(C.AGGREGATORS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--clients", type=int, default=5, help="clients, all active every round (one of them lies)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=200, help="samples per client")
    p.add_argument("--liar", default="0")
    p.add_argument(
        "--attack",
        default="scaled",
        choices=list(ATTACKS),
        help="; ".join(f"{k}: {h}" for k, (_, h) in ATTACKS.items()),
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print(f"bench/robust.py  {datetime.date.today()}  {hardware()}")
    print(
        f"{args.dataset}, {args.clients} clients all active, {args.rounds} rounds x {args.local_epochs} epochs, "
        f"{args.samples} samples each; liar {args.liar} uploads {ATTACKS[args.attack][1]}; seeds {args.seeds}"
    )
    header = f"{'strategy':<9} {'aggregator':<13} {'honest':>7} {'attacked':>8} {'paired diff':>12} "
    print(header + f"{'server s':>9} {'x mean':>7}  rejected, clipped: honest | attacked")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies:
            base_s = None
            for aggregator in args.aggregators:
                honest, attacked = [], []
                for seed in args.seeds:
                    cfg = config(args, strategy, aggregator, seed, Path(tmp) / f"{strategy}-{aggregator}-{seed}")
                    honest.append(one_run(cfg, args.liar, None))
                    cfg = dataclasses.replace(cfg, out=cfg.out + "-attacked")
                    attacked.append(one_run(cfg, args.liar, args.attack))
                diffs = [a["accuracy"] - h["accuracy"] for h, a in zip(honest, attacked)]
                server_s = statistics.fmean(r["server_s"] for r in honest)
                base_s = server_s if aggregator == "mean" or base_s is None else base_s
                print(
                    f"{strategy:<9} {aggregator:<13} {statistics.fmean(h['accuracy'] for h in honest):>7.3f} "
                    f"{statistics.fmean(a['accuracy'] for a in attacked):>8.3f} "
                    f"{' '.join(f'{d:+.3f}' for d in diffs):>12} {server_s:>9.2f} {server_s / base_s:>7.2f}  "
                    f"{[h['rejected'] for h in honest]}, {[h['clipped'] for h in honest]} | "
                    f"{[a['rejected'] for a in attacked]}, {[a['clipped'] for a in attacked]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
